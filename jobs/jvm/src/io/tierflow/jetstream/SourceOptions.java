package io.tierflow.jetstream;

import java.io.Serializable;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Map;

import org.apache.spark.sql.types.StructType;

/**
 * The options of one jetstream source, parsed and checked as
 * `jobs.jetstream_options.SourceOptions.parse` does (keys lower-cased: Spark's are
 * case-insensitive), with the same defaults and the same words for a bad value.
 */
final class SourceOptions implements Serializable {
  private static final long serialVersionUID = 1L;

  final Endpoint endpoint;
  final String stream;
  final List<String> subjects;
  final String starting;
  final long maxEvents;
  final boolean skipAgedOut;
  final String validate;
  final boolean invalidOnly;
  final int partitionSize;
  final int minPartitions;
  final int fetchBatch;
  final long fetchMaxBytes;
  final double timeoutSeconds;
  /** The events' fields (a Spark DDL) the source reads into columns of their own where it
   * can (FieldParser), or null: the `fields` option, taken with `validate=json` only. */
  final String fields;

  SourceOptions(Map<String, String> given) throws SourceException {
    Map<String, String> o = lower(given);
    if (empty(o.get("url"))) {
      throw new SourceException("jetstream source: option 'url' (the NATS server URL) is required");
    }
    if (empty(o.get("stream"))) {
      throw new SourceException("jetstream source: option 'stream' is required");
    }
    endpoint = new Endpoint(o);
    stream = o.get("stream");
    subjects = new ArrayList<>();
    for (String s : o.getOrDefault("subject", "").split(",")) {
      if (!s.trim().isEmpty()) {
        subjects.add(s.trim());
      }
    }
    String aged = o.getOrDefault("onagedout", "fail").toLowerCase(Locale.ROOT);
    if (!aged.equals("fail") && !aged.equals("skip")) {
      throw new SourceException("jetstream source: onAgedOut must be fail or skip, not '" + aged + "'");
    }
    skipAgedOut = aged.equals("skip");
    validate = o.getOrDefault("validate", "json").toLowerCase(Locale.ROOT);
    if (!List.of("json", "utf8", "none").contains(validate)) {
      throw new SourceException("jetstream source: validate must be one of ('json', 'utf8', "
          + "'none'), not '" + validate + "'");
    }
    invalidOnly = flag(o, "invalidonly", "invalidOnly");
    if (invalidOnly && validate.equals("none")) {
      throw new SourceException("jetstream source: invalidOnly needs validate json or utf8 "
          + "(with none no event is malformed)");
    }
    starting = offsetSpec(o.getOrDefault("startingoffset", "earliest"), "startingOffset");
    String ending = o.get("endingoffset");
    if (ending != null && !ending.isEmpty()) {
      throw new SourceException("jetstream source: endingOffset is for batch reads");
    }
    maxEvents = empty(o.get("maxeventspertrigger")) ? 0
        : positive(o, "maxeventspertrigger", "maxEventsPerTrigger", 0);
    partitionSize = (int) positive(o, "partitionsize", "partitionSize", 20000);
    minPartitions = (int) positive(o, "minpartitions", "minPartitions", 2);
    fetchBatch = (int) positive(o, "fetchbatch", "fetchBatch", 5000);
    fetchMaxBytes = positive(o, "fetchmaxbytes", "fetchMaxBytes", 16L << 20);
    String t = o.get("timeout");
    double timeout = 10.0;
    if (!empty(t)) {
      try {
        timeout = Double.parseDouble(t);
      } catch (NumberFormatException e) {
        timeout = 0;
      }
      if (!(timeout > 0)) {
        throw new SourceException("jetstream source: option 'timeout' must be a positive "
            + "number, not '" + t + "'");
      }
    }
    timeoutSeconds = timeout;
    fields = fieldsOf(o);
  }

  /** The `fields` DDL when the source reads it (the events are checked JSON and every field
   * is of a type FieldParser reads), else null. */
  static String fieldsOf(Map<String, String> lowered) {
    String ddl = lowered.get("fields");
    if (empty(ddl) || !lowered.getOrDefault("validate", "json").equalsIgnoreCase("json")
        || flag(lowered, "invalidonly")) {
      return null;
    }
    StructType schema;
    try {
      schema = StructType.fromDDL(ddl);
    } catch (Exception e) { // ParseException is checked, to Java
      return null; // Spark's from_json names what is wrong with it, in the query
    }
    return FieldParser.of(schema) == null ? null : ddl;
  }

  private static boolean flag(Map<String, String> o, String key) {
    return "true".equalsIgnoreCase(o.getOrDefault(key, "false").trim());
  }

  /** The options with their keys lower-cased (Spark's option names are case-insensitive). */
  static Map<String, String> lower(Map<String, String> options) {
    Map<String, String> o = new java.util.HashMap<>();
    options.forEach((k, v) -> o.put(k.toLowerCase(Locale.ROOT), v));
    return o;
  }

  private static boolean empty(String v) {
    return v == null || v.isEmpty();
  }

  private static boolean flag(Map<String, String> o, String key, String name) throws SourceException {
    String raw = o.getOrDefault(key, "false").trim().toLowerCase(Locale.ROOT);
    if (!raw.equals("true") && !raw.equals("false")) {
      throw new SourceException("jetstream source: option '" + name + "' must be true or false, not '" + raw + "'");
    }
    return raw.equals("true");
  }

  private static long positive(Map<String, String> o, String key, String name, long dflt)
      throws SourceException {
    String raw = o.get(key);
    if (empty(raw)) {
      return dflt;
    }
    long v;
    try {
      v = Long.parseLong(raw.trim());
    } catch (NumberFormatException e) {
      v = 0;
    }
    if (v < 1) {
      throw new SourceException("jetstream source: option '" + name + "' must be a positive "
          + "integer, not '" + raw + "'");
    }
    return v;
  }

  private static String offsetSpec(String raw, String name) throws SourceException {
    String v = raw.trim().toLowerCase(Locale.ROOT);
    if (v.equals("earliest") || v.equals("latest") || v.matches("[0-9]{1,18}") && Long.parseLong(v) >= 1) {
      return v;
    }
    throw new SourceException("jetstream source: option '" + name + "' must be earliest, "
        + "latest or a stream sequence >= 1, not '" + raw + "'");
  }
}
