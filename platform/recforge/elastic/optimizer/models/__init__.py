"""What DLRover-RM's stages decide with: the throughput model of a job (fitted per job, with our trainer's measured
profile as the cold-start prior), the per-worker memory model, past jobs as history, and their MLflow store."""
