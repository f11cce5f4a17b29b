"""Durable state: LevelDB checkpoints (`checkpoint`), k-fault-tolerant replica groups and
their epoch fence (`replication`, placed by `placement`), and files replaced whole
(`files`)."""
