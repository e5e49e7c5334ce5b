"""DLRover-RM style elastic training: job master with dynamic data sharding, resource policies,
launch backends. Import the submodules directly (recforge.elastic.master.service, .client, ...)."""
