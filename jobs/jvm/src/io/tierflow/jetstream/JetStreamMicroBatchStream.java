package io.tierflow.jetstream;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.util.List;

import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.connector.read.streaming.Offset;
import org.apache.spark.sql.connector.read.streaming.ReadLimit;
import org.apache.spark.sql.connector.read.streaming.ReadMaxRows;
import org.apache.spark.sql.connector.read.streaming.SupportsAdmissionControl;
import org.apache.spark.sql.connector.read.streaming.SupportsTriggerAvailableNow;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Micro-batches over stream sequence ranges, with the offset policy of
 * `jobs.jetstream_options.next_offset`: a start below the stream's first sequence fails or,
 * with onAgedOut=skip, moves to the first and counts the gap (not on a stream that removes
 * only by compaction, whose gaps are superseded events); maxEventsPerTrigger caps a batch's
 * span and Trigger.AvailableNow its end. Spark writes each batch's range to its checkpoint
 * before running it, so a restarted query reads exactly its uncommitted range again.
 */
final class JetStreamMicroBatchStream implements MicroBatchStream, SupportsAdmissionControl,
    SupportsTriggerAvailableNow {
  private static final Logger LOG = LoggerFactory.getLogger(JetStreamMicroBatchStream.class);

  private final SourceOptions opts;
  private NatsConnection control;
  private Bounds latest;
  private long target = -1;

  JetStreamMicroBatchStream(SourceOptions opts) {
    this.opts = opts;
  }

  private synchronized Bounds bounds() {
    long timeoutNs = (long) (opts.timeoutSeconds * 1e9);
    for (int attempt = 0; ; attempt++) {
      try {
        if (control == null || !control.healthy()) {
          closeControl();
          control = opts.endpoint.connect((int) (opts.timeoutSeconds * 1000));
        }
        latest = Bounds.of(control.request("$JS.API.STREAM.INFO." + opts.stream, new byte[0],
            timeoutNs), opts.stream);
        return latest;
      } catch (SourceException e) {
        throw new IllegalStateException(e.getMessage(), e);
      } catch (IOException e) {
        closeControl();
        if (attempt >= 1) { // once more on a new connection: an idle one may have been dropped
          throw new UncheckedIOException("jetstream source: stream '" + opts.stream + "': " + e.getMessage(), e);
        }
      }
    }
  }

  @Override
  public Offset initialOffset() {
    Bounds b = bounds();
    long start = switch (opts.starting) {
      case "earliest" -> b.earliest();
      case "latest" -> b.latest();
      default -> Long.parseLong(opts.starting);
    };
    return new SeqOffset(start, 0);
  }

  @Override
  public Offset latestOffset() {
    throw new UnsupportedOperationException("latestOffset(Offset, ReadLimit) is used");
  }

  @Override
  public ReadLimit getDefaultReadLimit() {
    return opts.maxEvents > 0 ? ReadLimit.maxRows(opts.maxEvents) : ReadLimit.allAvailable();
  }

  @Override
  public void prepareForTriggerAvailableNow() {
    target = bounds().latest();
  }

  @Override
  public Offset latestOffset(Offset startOffset, ReadLimit limit) {
    SeqOffset start = SeqOffset.of(startOffset);
    Bounds b = bounds();
    long skipped = start.skipped;
    long base = start.seq;
    if (b.agedOut(start.seq)) {
      if (!opts.skipAgedOut) {
        throw new IllegalStateException(Bounds.agedOutMessage(opts.stream, start.seq, b.first));
      }
      skipped += b.first - start.seq;
      base = b.first;
      LOG.warn("jetstream stream '{}': sequences {}..{} aged out before they were read; skipping"
          + " to {} ({} skipped in total)", opts.stream, start.seq, b.first - 1, b.first, skipped);
    }
    long end = Math.max(base, target < 0 ? b.latest() : Math.min(b.latest(), target));
    if (limit instanceof ReadMaxRows) {
      end = Math.min(end, base + Math.max(1, ((ReadMaxRows) limit).maxRows()));
    }
    return new SeqOffset(end, skipped);
  }

  @Override
  public Offset reportLatestOffset() {
    Bounds b = latest;
    return b == null ? null : new SeqOffset(b.latest(), 0);
  }

  @Override
  public InputPartition[] planInputPartitions(Offset startOffset, Offset endOffset) {
    SeqOffset start = SeqOffset.of(startOffset);
    SeqOffset end = SeqOffset.of(endOffset);
    // a skip recorded in `end` moved the batch's first sequence past the aged-out gap
    long first = start.seq + end.skipped - start.skipped;
    Bounds b = latest;
    if (b != null && b.compacted) {
      first = Math.max(first, Math.min(b.first, end.seq)); // superseded, never coming back
    }
    List<SeqRange> parts = SeqRange.split(first, end.seq, opts.partitionSize, opts.minPartitions);
    return parts.toArray(new InputPartition[0]);
  }

  @Override
  public PartitionReaderFactory createReaderFactory() {
    return new RangeReaderFactory(opts);
  }

  @Override
  public Offset deserializeOffset(String json) {
    return SeqOffset.parse(json);
  }

  @Override
  public void commit(Offset end) {
    // nothing to release: the stream keeps events by its own limits, not by our reads
  }

  @Override
  public synchronized void stop() {
    closeControl();
  }

  private void closeControl() {
    if (control != null) {
      control.close();
      control = null;
    }
  }
}
