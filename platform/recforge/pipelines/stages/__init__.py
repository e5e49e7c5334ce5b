"""The pipeline's stages, one module per group: data (generate, ingest), plan (plan_resources), train (train,
evaluate), serve (compile, publish). Each reads earlier stages' typed outputs and commits its own."""
