"""How announced work reaches the stages: in-memory queues in one process, Kafka topics across services."""
