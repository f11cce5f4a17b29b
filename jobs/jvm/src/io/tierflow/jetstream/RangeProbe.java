package io.tierflow.jetstream;

import java.io.Closeable;
import java.io.IOException;
import java.util.Map;

/**
 * One range read step by step from the driver's JVM (through py4j): what a task's reader
 * does, with the caller in control between events, so a test can take the consumer away
 * mid-read and see the reader replace it.
 */
public final class RangeProbe implements Closeable {
  private final NatsConnection nc;
  private final RangeReader reader;

  public RangeProbe(Map<String, String> options, long start, long end) throws IOException {
    SourceOptions opts = new SourceOptions(options);
    nc = opts.endpoint.connect((int) (opts.timeoutSeconds * 1000));
    reader = new RangeReader(opts, start, end, nc);
    try {
      reader.open();
    } catch (IOException e) {
      nc.close();
      throw e;
    }
  }

  /** The next event's stream sequence, or -1 when the range is done. */
  public long next() throws IOException {
    return reader.advance() ? reader.seq : -1;
  }

  /** Consumers this read has started (1 unless one was replaced). */
  public int consumers() {
    return reader.consumersStarted();
  }

  @Override
  public void close() {
    reader.close();
    nc.close();
  }
}
