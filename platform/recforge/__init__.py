"""recforge: train and serve deep learning recommendation models (RAP preprocessing, DLRover-RM elastic
training, RECom compiled inference), orchestrated by Airflow and tracked by MLflow."""

__version__ = "0.1.0"
