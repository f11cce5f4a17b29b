"""Starting, stopping or reaching the engines (NATS JetStream, Ray, Spark: `services`) and
the Spark driver JVM's class-data-sharing archive (`class_archive`)."""
