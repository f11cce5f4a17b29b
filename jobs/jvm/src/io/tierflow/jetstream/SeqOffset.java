package io.tierflow.jetstream;

import java.io.IOException;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.spark.sql.connector.read.streaming.Offset;

/**
 * `{"seq": N, "skipped": K}`: the next sequence to read and the sequences skipped as aged
 * out, written as the Python source writes them, so either source reads the other's
 * checkpoint.
 */
final class SeqOffset extends Offset {
  private static final ObjectMapper MAPPER = new ObjectMapper();

  final long seq;
  final long skipped;

  SeqOffset(long seq, long skipped) {
    this.seq = seq;
    this.skipped = skipped;
  }

  static SeqOffset parse(String json) {
    try {
      JsonNode n = MAPPER.readTree(json);
      return new SeqOffset(n.path("seq").asLong(), n.path("skipped").asLong(0));
    } catch (IOException e) {
      throw new IllegalArgumentException("jetstream source: bad offset " + json, e);
    }
  }

  static SeqOffset of(Offset o) {
    return o instanceof SeqOffset ? (SeqOffset) o : parse(o.json());
  }

  @Override
  public String json() {
    return "{\"seq\": " + seq + ", \"skipped\": " + skipped + "}";
  }
}
