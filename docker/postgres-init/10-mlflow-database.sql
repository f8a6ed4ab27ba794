-- The Prefect server uses the database POSTGRES_DB (prefect); MLflow gets its own.
CREATE DATABASE mlflow;
