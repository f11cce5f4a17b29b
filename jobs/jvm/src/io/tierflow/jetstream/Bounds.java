package io.tierflow.jetstream;

import com.fasterxml.jackson.databind.JsonNode;

/**
 * A stream's first and last sequence, and whether it only ever drops a message for a newer
 * one of its subject: `jobs.jetstream_options.Bounds` and `only_compaction`, the same rules.
 */
final class Bounds {
  final long first;
  final long last;
  final boolean compacted;

  Bounds(long first, long last, boolean compacted) {
    this.first = first;
    this.last = last;
    this.compacted = compacted;
  }

  /** From a `$JS.API.STREAM.INFO` answer; an error naming the stream when it is missing. */
  static Bounds of(JsonNode info, String stream) throws SourceException {
    JsonNode err = info.get("error");
    if (err != null) {
      if (err.path("err_code").asInt() == 10059) {
        throw new SourceException("jetstream source: stream '" + stream + "' does not exist");
      }
      throw new SourceException("jetstream source: stream '" + stream + "': "
          + err.path("description").asText());
    }
    JsonNode c = info.path("config");
    JsonNode s = info.path("state");
    return new Bounds(s.path("first_seq").asLong(0), s.path("last_seq").asLong(0),
        onlyCompaction(c.path("max_msgs_per_subject").asLong(0), c.path("max_age").asLong(0),
            c.path("max_msgs").asLong(-1), c.path("max_bytes").asLong(-1),
            c.path("discard").asText("old")));
  }

  static boolean onlyCompaction(long perSubject, long maxAge, long maxMsgs, long maxBytes,
      String discard) {
    if (perSubject < 1 || maxAge != 0) {
      return false;
    }
    return (maxMsgs < 0 && maxBytes < 0) || "new".equalsIgnoreCase(discard);
  }

  boolean agedOut(long start) {
    return first > start && !compacted;
  }

  long earliest() {
    return Math.max(first, 1);
  }

  /** The next sequence the stream will write: an exclusive end. */
  long latest() {
    return last + 1;
  }

  /** The words of `jobs.jetstream_options.AgedOutError`. */
  static String agedOutMessage(String stream, long start, long first) {
    return "jetstream stream '" + stream + "': start sequence " + start + " has aged out; the"
        + " first sequence the stream still holds is " + first + " (up to " + (first - start)
        + " events lost to the stream's limits). Set option onAgedOut=skip to continue from "
        + first + ", or start a new query.";
  }
}
