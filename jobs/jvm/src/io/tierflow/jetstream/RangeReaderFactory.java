package io.tierflow.jetstream;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ConcurrentLinkedDeque;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/**
 * A task's rows: one `RangeReader` per partition on a connection taken from this JVM's pool
 * (tasks run one after another on an executor's threads; a connection goes back only when its
 * read ended cleanly). Every event becomes a row; a malformed one has `valid` false, `error`
 * saying why and `raw` its bytes (with invalidOnly, only those become rows).
 */
final class RangeReaderFactory implements PartitionReaderFactory {
  private static final long serialVersionUID = 1L;
  private static final Map<Endpoint, ConcurrentLinkedDeque<NatsConnection>> POOL =
      new ConcurrentHashMap<>();
  private static final byte[] MSG_ID = "\r\nNats-Msg-Id:".getBytes(StandardCharsets.US_ASCII);

  private final SourceOptions opts;

  RangeReaderFactory(SourceOptions opts) {
    this.opts = opts;
  }

  @Override
  public boolean supportColumnarReads(InputPartition partition) {
    return true;
  }

  @Override
  public PartitionReader<InternalRow> createReader(InputPartition partition) {
    throw new UnsupportedOperationException("the jetstream source reads in columnar batches");
  }

  @Override
  public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
    SeqRange range = (SeqRange) partition;
    try {
      return new Batches(opts, range);
    } catch (IOException e) {
      throw new UncheckedIOException(e.getMessage(), e);
    }
  }

  private static NatsConnection take(SourceOptions opts) throws IOException {
    ConcurrentLinkedDeque<NatsConnection> idle = POOL.computeIfAbsent(opts.endpoint,
        k -> new ConcurrentLinkedDeque<>());
    for (NatsConnection c; (c = idle.pollFirst()) != null; ) {
      if (c.healthy()) {
        return c;
      }
      c.close();
    }
    return opts.endpoint.connect((int) (opts.timeoutSeconds * 1000));
  }

  /**
   * Columnar batches of up to `fetchBatch` events: each event's bytes go from the connection's
   * read buffer straight into the column vectors (one copy), and Spark turns the batch into
   * rows with generated code, as it does for Parquet.
   */
  private static final class Batches implements PartitionReader<ColumnarBatch> {
    private static final int SEQ = 0;
    private static final int SUBJECT = 1;
    private static final int TS = 2;
    private static final int ID = 3;
    private static final int DATA = 4;
    private static final int VALID = 5;
    private static final int ERROR = 6;
    private static final int RAW = 7;
    private static final int PARSED = 8;

    private final SourceOptions opts;
    private final RangeReader reader;
    private final int capacity;
    private final OnHeapColumnVector[] columns;
    private final ColumnarBatch batch;
    /** The events' fields into `columns[PARSED + 1 ...]`, or null (SourceOptions.fields). */
    private final FieldParser fields;
    private NatsConnection nc;
    private boolean clean;
    private boolean done;

    Batches(SourceOptions opts, SeqRange range) throws IOException {
      this.opts = opts;
      RangeReader r = null;
      for (int attempt = 0; r == null; attempt++) {
        nc = take(opts);
        RangeReader tried = new RangeReader(opts, range.start, range.end, nc);
        try {
          tried.open();
          r = tried;
        } catch (SourceException e) {
          nc.close();
          throw e;
        } catch (IOException e) { // a pooled connection the server dropped while idle
          nc.close();
          if (attempt >= 1) {
            throw e;
          }
        }
      }
      reader = r;
      capacity = (int) Math.max(1, Math.min(opts.fetchBatch, range.end - range.start));
      StructType declared = opts.fields == null ? null : StructType.fromDDL(opts.fields);
      fields = declared == null ? null : FieldParser.of(declared);
      StructType schema = fields == null ? JetStreamProvider.SCHEMA
          : JetStreamProvider.withFields(declared);
      columns = OnHeapColumnVector.allocateColumns(capacity, schema);
      batch = new ColumnarBatch(columns);
    }

    @Override
    public boolean next() throws IOException {
      if (done) {
        return false;
      }
      for (OnHeapColumnVector c : columns) {
        c.reset();
      }
      int n = 0;
      while (n < capacity) {
        if (!reader.advance()) {
          done = true;
          clean = true;
          break;
        }
        byte[] buf = nc.buffer();
        String error = Payloads.error(buf, nc.dataOff, nc.dataLen, opts.validate);
        if (opts.invalidOnly && error == null) {
          continue;
        }
        put(n++, buf, error);
      }
      batch.setNumRows(n);
      return n > 0; // none only when the range is done
    }

    private void put(int i, byte[] buf, String error) {
      columns[SEQ].putLong(i, reader.seq);
      text(columns[SUBJECT], i, buf, nc.subjectOff, nc.subjectLen);
      columns[TS].putLong(i, Math.floorDiv(reader.tsNanos, 1000L));
      long id = msgId(buf);
      if (id < 0) {
        columns[ID].putNull(i);
      } else {
        text(columns[ID], i, buf, (int) (id >>> 32), (int) id);
      }
      if (error == null) {
        if (opts.validate.equals("none")) {
          text(columns[DATA], i, buf, nc.dataOff, nc.dataLen);
        } else {
          columns[DATA].putByteArray(i, buf, nc.dataOff, nc.dataLen);
        }
        columns[VALID].putBoolean(i, true);
        columns[ERROR].putNull(i);
        columns[RAW].putNull(i);
        if (fields != null) {
          columns[PARSED].putBoolean(i,
              fields.parse(buf, nc.dataOff, nc.dataLen, columns, PARSED + 1, i));
        }
        return;
      }
      if (fields != null) {
        columns[PARSED].putBoolean(i, false);
        fields.nulls(columns, PARSED + 1, i);
      }
      if (error.startsWith(Payloads.NOT_UTF8)) {
        columns[DATA].putNull(i); // the bytes are in `raw`
      } else {
        columns[DATA].putByteArray(i, buf, nc.dataOff, nc.dataLen);
      }
      columns[VALID].putBoolean(i, false);
      byte[] why = error.getBytes(StandardCharsets.UTF_8);
      columns[ERROR].putByteArray(i, why, 0, why.length);
      columns[RAW].putByteArray(i, buf, nc.dataOff, nc.dataLen);
    }

    /** The header block's Nats-Msg-Id, as `jobs.jetstream_read.msg_ids` finds it: its offset
     * in the high 32 bits and its length in the low ones (no allocation per event); -1 when it
     * has none. */
    private long msgId(byte[] buf) {
      if (nc.headerOff < 0) {
        return -1;
      }
      int end = nc.headerOff + nc.headerLen;
      outer:
      for (int i = nc.headerOff; i + MSG_ID.length <= end; i++) {
        for (int k = 0; k < MSG_ID.length; k++) {
          if (buf[i + k] != MSG_ID[k]) {
            continue outer;
          }
        }
        int s = i + MSG_ID.length;
        int e = s;
        while (e < end && buf[e] != '\r' && buf[e] != '\n') {
          e++;
        }
        if (e + 1 >= end || buf[e] != '\r' || buf[e + 1] != '\n') {
          continue; // the regex wants the line to end in CRLF
        }
        while (s < e && (buf[s] == ' ' || buf[s] == '\t')) {
          s++;
        }
        int t = e;
        while (t > s && (buf[t - 1] == ' ' || buf[t - 1] == '\t')) {
          t--;
        }
        return ((long) s << 32) | (t - s);
      }
      return -1;
    }

    /** Text as it is when it is UTF-8, else with U+FFFD for what is not, as Python's
     * `decode("utf-8", "replace")` puts them. */
    private static void text(OnHeapColumnVector col, int i, byte[] buf, int off, int len) {
      if (Payloads.utf8Error(buf, off, len) < 0) {
        col.putByteArray(i, buf, off, len);
      } else {
        byte[] fixed = Payloads.replaceInvalid(buf, off, len);
        col.putByteArray(i, fixed, 0, fixed.length);
      }
    }

    @Override
    public ColumnarBatch get() {
      return batch;
    }

    @Override
    public void close() {
      reader.close();
      batch.close();
      if (clean && nc.healthy()) {
        POOL.computeIfAbsent(opts.endpoint, k -> new ConcurrentLinkedDeque<>()).addFirst(nc);
      } else {
        nc.close();
      }
    }
  }
}
