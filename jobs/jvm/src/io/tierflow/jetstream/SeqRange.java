package io.tierflow.jetstream;

import java.util.ArrayList;
import java.util.List;

import org.apache.spark.sql.connector.read.InputPartition;

/** Stream sequences [start, end) read by one Spark task. */
final class SeqRange implements InputPartition {
  private static final long serialVersionUID = 1L;
  static final int MIN_SPLIT = 5_000;

  final long start;
  final long end;

  SeqRange(long start, long end) {
    this.start = start;
    this.end = end;
  }

  /** `jobs.jetstream_options.split_range`: at most `size` each, at least `minParts` when
   * each still holds `MIN_SPLIT` sequences. */
  static List<SeqRange> split(long start, long end, long size, int minParts) {
    List<SeqRange> out = new ArrayList<>();
    long span = end - start;
    if (span <= 0) {
      return out;
    }
    size = Math.max(1, size);
    long parts = Math.min(minParts, span / MIN_SPLIT);
    long bySize = (span + size - 1) / size;
    long step = parts <= bySize ? size : (span + parts - 1) / parts;
    for (long s = start; s < end; s += step) {
      out.add(new SeqRange(s, Math.min(s + step, end)));
    }
    return out;
  }
}
