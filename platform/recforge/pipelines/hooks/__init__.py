"""Where the stages call into the seed systems: RAP planning and co-run bookkeeping, DLRover-RM's stage 1 and its
stages 2-3 around the training job. The seed systems hold no pipeline glue; it lives here."""
