"""Task functions the DAGs call: plain Python, testable without Airflow.

Each stage takes a RunContext (run key + pipeline config), reads the recorded outputs of earlier
stages and records its own atomically, under one MLflow child run per stage. Modules here import
their heavy dependencies inside functions, so DAG parsing stays fast.
"""
