package io.tierflow.jetstream;

import java.util.Map;
import java.util.Set;

import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * The jetstream source on the JVM: `spark.readStream.format("io.tierflow.jetstream.JetStreamProvider")`,
 * the options, schema, offsets and rows of `jobs/jetstream.py`'s Python source, read by
 * Spark's own task threads instead of a Python worker per task (which costs as much CPU per
 * event as Spark's whole query on the stateless Nexmark queries, docs/benchmarks.md).
 * Streaming reads only: batch reads (a stream-static join's table) stay on the Python source.
 */
public final class JetStreamProvider implements TableProvider {
  static final StructType SCHEMA = new StructType()
      .add("seq", DataTypes.LongType)
      .add("subject", DataTypes.StringType)
      .add("ts", DataTypes.TimestampType)
      .add("msg_id", DataTypes.StringType)
      .add("data", DataTypes.StringType)
      .add("valid", DataTypes.BooleanType)
      .add("error", DataTypes.StringType)
      .add("raw", DataTypes.BinaryType);

  /** Spark's name for the column that says the row's fields were read by the source. */
  static final String PARSED = "_tf_parsed";

  /** The rows' schema: `SCHEMA`, then, with a `fields` option the source reads
   * (SourceOptions.fieldsOf), `_tf_parsed` and each field's column (`_tf_f0`, ...), null
   * where `_tf_parsed` is false and Spark's from_json is to read the event. */
  static StructType schemaFor(Map<String, String> options) {
    String ddl = SourceOptions.fieldsOf(SourceOptions.lower(options));
    return ddl == null ? SCHEMA : withFields(StructType.fromDDL(ddl));
  }

  /** `SCHEMA`, `_tf_parsed`, then a column per field of `fields`. */
  static StructType withFields(StructType fields) {
    StructType out = SCHEMA.add(PARSED, DataTypes.BooleanType);
    StructField[] each = fields.fields();
    for (int i = 0; i < each.length; i++) {
      out = out.add("_tf_f" + i, each[i].dataType());
    }
    return out;
  }

  @Override
  public StructType inferSchema(CaseInsensitiveStringMap options) {
    return schemaFor(options.asCaseSensitiveMap());
  }

  @Override
  public Table getTable(StructType schema, Transform[] partitioning, Map<String, String> properties) {
    return new JetStreamTable(properties);
  }

  private static final class JetStreamTable implements Table, SupportsRead {
    private final Map<String, String> properties;

    JetStreamTable(Map<String, String> properties) {
      this.properties = properties;
    }

    @Override
    public String name() {
      return "jetstream(" + properties.getOrDefault("stream", "?") + ")";
    }

    @Override
    public StructType schema() {
      return schemaFor(properties);
    }

    @Override
    public Set<TableCapability> capabilities() {
      return Set.of(TableCapability.MICRO_BATCH_READ);
    }

    @Override
    public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
      return () -> new JetStreamScan(options.asCaseSensitiveMap());
    }
  }

  private static final class JetStreamScan implements Scan {
    private final Map<String, String> options;

    JetStreamScan(Map<String, String> options) {
      this.options = options;
    }

    @Override
    public StructType readSchema() {
      return schemaFor(options);
    }

    @Override
    public String description() {
      return "jetstream(stream=" + SourceOptions.lower(options).get("stream") + ")";
    }

    @Override
    public MicroBatchStream toMicroBatchStream(String checkpointLocation) {
      try {
        return new JetStreamMicroBatchStream(new SourceOptions(options));
      } catch (SourceException e) {
        throw new IllegalArgumentException(e.getMessage(), e);
      }
    }
  }
}
