package io.tierflow.jetstream;

import java.util.Map;

/** `java -cp ... io.tierflow.jetstream.ReadBench URL STREAM [validate]`: one range, timed. */
public final class ReadBench {
  private ReadBench() {}

  public static void main(String[] args) throws Exception {
    SourceOptions o = new SourceOptions(Map.of("url", args[0], "stream", args[1],
        "validate", args.length > 2 ? args[2] : "json"));
    for (int round = 0; round < 3; round++) {
      long t0 = System.nanoTime();
      long n = 0;
      long bytes = 0;
      long bad = 0;
      try (NatsConnection nc = o.endpoint.connect(10000);
           RangeReader r = new RangeReader(o, 1, Long.MAX_VALUE / 2, nc)) {
        r.open();
        while (r.advance()) {
          n++;
          bytes += nc.dataLen;
          if (Payloads.error(nc.buffer(), nc.dataOff, nc.dataLen, o.validate) != null) {
            bad++;
          }
        }
      }
      double s = (System.nanoTime() - t0) / 1e9;
      System.out.printf("%d events, %d bytes, %d bad in %.3f s: %.0f events/s%n", n, bytes, bad, s, n / s);
    }
  }
}
