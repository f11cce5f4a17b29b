package io.tierflow.jetstream;

import java.io.Closeable;
import java.io.IOException;
import java.util.Map;

/**
 * One range read step by step from the driver's JVM (through py4j): what a task's reader
 * does, with the caller in control between events, so a test can take the consumer away
 * mid-read and see the reader replace it; and a task's payload check alone.
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

  /**
   * Reads [start, end) whole on this thread, checking each payload as a task does:
   * {events, this thread's CPU in ns, payload bytes}, for the source's own cost per event
   * without Spark (tests/bench/bench_nexmark.py).
   */
  public static long[] readAll(Map<String, String> options, long start, long end)
      throws IOException {
    java.lang.management.ThreadMXBean mx = java.lang.management.ManagementFactory.getThreadMXBean();
    long cpu0 = mx.getCurrentThreadCpuTime();
    long events = 0;
    long bytes = 0;
    try (RangeProbe probe = new RangeProbe(options, start, end)) {
      SourceOptions opts = probe.reader.options();
      while (probe.reader.advance()) {
        events++;
        bytes += probe.nc.dataLen;
        Payloads.error(probe.nc.buffer(), probe.nc.dataOff, probe.nc.dataLen, opts.validate);
      }
    }
    return new long[] {events, mx.getCurrentThreadCpuTime() - cpu0, bytes};
  }

  /** Why a task would find `payload` malformed under `validate`, or null: the check alone,
   * for comparing its words with the Python source's over many payloads. */
  public static String payloadError(byte[] payload, String validate) {
    return Payloads.error(payload, 0, payload.length, validate);
  }

  /** A payload as the text a row holds with `validate=none`. */
  public static String asText(byte[] payload) {
    return new String(Payloads.replaceInvalid(payload, 0, payload.length),
        java.nio.charset.StandardCharsets.UTF_8);
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
