"""The RecForge page: a read-only FastAPI app the Airflow plugin (plugins/recforge_plugin.py) mounts at /recforge.

It shows, per pipeline run, what the stages recorded (their outputs.json under $RECFORGE_HOME/runs/) and what
MLflow holds for them (read through recforge.tracking), each section only where its data exists.
"""
