"""Geo replication of streams between sites: which sites hold a stream (`config`), the
sites as JetStream domains joined by leaf nodes (`sites`) and the copies between them
(`replication`)."""
