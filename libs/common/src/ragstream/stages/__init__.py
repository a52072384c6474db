"""Pipeline stages shared by the Kafka services and the embedded runner: fetch, chunk, embed, index."""
