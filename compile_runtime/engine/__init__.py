"""The engine: ``cr.LLM`` runs the scheduler loop in the driver process and reaches the model
runner on every rank through an executor."""
