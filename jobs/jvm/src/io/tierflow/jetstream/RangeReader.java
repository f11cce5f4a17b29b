package io.tierflow.jetstream;

import java.io.Closeable;
import java.io.IOException;
import java.net.SocketTimeoutException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayDeque;
import java.util.Arrays;
import java.util.List;
import java.util.UUID;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Reads stream sequences [start, end) of one stream, in order, through an ephemeral pull
 * consumer of its own (ack none, in memory, from the start sequence, with the subject
 * filter), the same read as `jobs/jetstream_read.py` does in a Python worker.
 *
 * <p>Pulls are no-wait and ask for no more messages in all than the range can hold, two in
 * flight, so the server is sending the next while the caller turns the last into rows. A
 * consumer with nothing left before the range's end is checked against the stream's leader
 * (a message get) before the range is taken as done: an R1 consumer may sit on a replica
 * still catching up. A pull answered with no message because its first event is bigger than
 * the byte cap is followed by a pull for that one event without a cap.
 */
final class RangeReader implements Closeable {
  private static final ObjectMapper MAPPER = new ObjectMapper();
  private static final Logger LOG = LoggerFactory.getLogger(RangeReader.class);
  private static final int RESTARTS = 5;
  private static final long LAGGING_REPLICA_WAIT_MS = 500;
  private static final long INACTIVE_NS = 60_000_000_000L;
  private static final int PULL_BYTES_SLACK = 16 * 1024;

  private final SourceOptions opts;
  private final long end;
  private final NatsConnection nc;
  private final long timeoutNs;
  private final ArrayDeque<int[]> pulls = new ArrayDeque<>(); // {wanted, received}
  private long next;
  private String consumer;
  private String deliverSubject;
  private int sid;
  private int consumers;
  private int restartsLeft = RESTARTS;
  private boolean finished;
  private boolean uncappedNext;
  private boolean checkEnd;
  private long lastPending = -1;

  /** The delivery `advance` stopped at: its sequence, time (ns since the epoch) and frame. */
  long seq;
  long tsNanos;

  RangeReader(SourceOptions opts, long start, long end, NatsConnection nc) {
    this.opts = opts;
    this.end = end;
    this.next = start;
    this.nc = nc;
    this.timeoutNs = (long) (opts.timeoutSeconds * 1e9);
  }

  SourceOptions options() {
    return opts;
  }

  int consumersStarted() {
    return consumers;
  }

  /** Checks the start against the stream's first sequence, then starts the consumer. */
  void open() throws IOException {
    Bounds b = Bounds.of(nc.request("$JS.API.STREAM.INFO." + opts.stream, new byte[0], timeoutNs), opts.stream);
    if (b.agedOut(next)) {
      if (!opts.skipAgedOut) {
        throw new SourceException(Bounds.agedOutMessage(opts.stream, next, b.first));
      }
      LOG.warn("jetstream stream '{}': {} sequences from {} aged out before they were read",
          opts.stream, Math.min(b.first, end) - next, next);
    }
    if (next < end) {
      startConsumer();
    } else {
      finished = true;
    }
  }

  /** Moves to the next delivery in the range; false when the range is done. */
  boolean advance() throws IOException {
    if (checkEnd) { // after the row handed out last: its frame is no longer needed
      checkEnd = false;
      confirmEnd();
    }
    while (!finished) {
      fill();
      if (finished) {
        return false;
      }
      long deadline = System.nanoTime() + timeoutNs;
      int kind;
      try {
        kind = nc.next(deadline);
      } catch (SocketTimeoutException e) {
        restart("no answer to a pull within " + opts.timeoutSeconds + " s");
        continue;
      }
      if (kind != NatsConnection.FRAME_MSG || !forUs()) {
        continue;
      }
      byte[] buf = nc.buffer();
      if (nc.replyLen == 0 && nc.headerOff >= 0 && nc.headerLen > 12 && buf[nc.headerOff + 8] == ' ') {
        status(new String(buf, nc.headerOff + 9, 3, StandardCharsets.US_ASCII),
            new String(buf, nc.headerOff + 9, nc.headerLen - 9, StandardCharsets.UTF_8).trim());
        continue;
      }
      if (nc.replyLen == 0) {
        continue; // not a delivery (a status without a header block is not sent for pulls)
      }
      parseReply(buf, nc.replyOff, nc.replyLen);
      int[] head = pulls.peekFirst();
      if (head != null && ++head[1] >= head[0]) {
        pulls.pollFirst();
      }
      if (seq < next) {
        continue; // a consumer started again re-delivers nothing before `next`; be safe
      }
      if (seq >= end) {
        finished = true;
        return false;
      }
      next = seq + 1;
      if (next >= end) {
        finished = true;
      } else if (lastPending == 0) {
        checkEnd = true;
      }
      return true;
    }
    return false;
  }

  /** Keeps two pulls in flight, never asking for more messages than the range can hold. */
  private void fill() throws IOException {
    while (!finished && pulls.size() < 2) {
      long asked = 0;
      for (int[] p : pulls) {
        asked += p[0] - p[1];
      }
      long room = end - next - asked;
      if (room <= 0) {
        if (pulls.isEmpty()) {
          finished = true; // every wanted message came: the range is complete
        }
        return;
      }
      String body;
      int want;
      if (uncappedNext) {
        if (!pulls.isEmpty()) {
          return;
        }
        uncappedNext = false;
        want = 1;
        body = "{\"batch\":1,\"no_wait\":true}";
      } else {
        want = (int) Math.min(opts.fetchBatch, room);
        long maxBytes = Math.max(opts.fetchMaxBytes, nc.maxPayload + PULL_BYTES_SLACK);
        body = "{\"batch\":" + want + ",\"max_bytes\":" + maxBytes + ",\"no_wait\":true}";
      }
      nc.publish("$JS.API.CONSUMER.MSG.NEXT." + opts.stream + "." + consumer, deliverSubject,
          body.getBytes(StandardCharsets.US_ASCII));
      pulls.addLast(new int[] {want, 0});
    }
  }

  private boolean forUs() {
    return consumer != null && nc.sid == sid;
  }

  /** A status message ends the oldest pull in flight; what it means for the range. */
  private void status(String code, String text) throws IOException {
    if (text.startsWith("409 Batch Completed")) {
      return; // said after a pull that ended on its count: already taken off
    }
    int[] head = pulls.pollFirst();
    switch (code) {
      case "404":
      case "408":
        if (head != null && head[1] == 0 && pulls.isEmpty()) {
          confirmEnd(); // nothing more now: done, unless the leader holds more
        }
        return;
      case "409":
        if (text.contains("Exceeds MaxBytes")) {
          if (head != null && head[1] == 0) {
            uncappedNext = true; // its first event is bigger than the cap: ask for it alone
          }
          return;
        }
        restart(text);
        return;
      case "100":
        if (head != null) {
          pulls.addFirst(head); // a heartbeat ends nothing
        }
        return;
      default:
        restart(text);
    }
  }

  /**
   * The consumer has nothing pending: the range is done unless the stream's leader holds a
   * wanted message before the end, which a new consumer then reads on from.
   */
  private void confirmEnd() throws IOException {
    if (next >= end) {
      finished = true;
      return;
    }
    long left = leaderNext();
    if (left < 0 || left >= end) {
      finished = true;
      return;
    }
    if (restartsLeft-- <= 0) {
      throw new SourceException("jetstream source: reading stream '" + opts.stream
          + "': its consumers end at sequence " + (next - 1) + ", the stream's leader holds "
          + left + " in the range up to " + (end - 1));
    }
    LOG.warn("jetstream source: stream '{}': the consumer had nothing after sequence {}, the"
        + " stream's leader has {}; reading on from a new consumer", opts.stream, next - 1, left);
    sleep(LAGGING_REPLICA_WAIT_MS);
    startConsumer();
  }

  /** The first sequence at or after `next` holding a wanted message, by the leader; -1: none. */
  private long leaderNext() throws IOException {
    long found = -1;
    List<String> subjects = opts.subjects.isEmpty() ? List.of(">") : opts.subjects;
    for (String subject : subjects) {
      ObjectNode q = MAPPER.createObjectNode();
      q.put("seq", next);
      q.put("next_by_subj", subject);
      JsonNode r = nc.request("$JS.API.STREAM.MSG.GET." + opts.stream, MAPPER.writeValueAsBytes(q), timeoutNs);
      JsonNode msg = r.get("message");
      if (msg != null && msg.has("seq")) {
        long s = msg.get("seq").asLong();
        found = found < 0 ? s : Math.min(found, s);
      } else if (r.has("error") && r.get("error").path("code").asInt() != 404) {
        throw new SourceException("jetstream source: message get on '" + opts.stream + "': "
            + r.get("error").path("description").asText());
      }
    }
    return found;
  }

  private void restart(String problem) throws IOException {
    if (restartsLeft-- <= 0) {
      throw new SourceException("jetstream source: reading stream '" + opts.stream
          + "' from sequence " + next + ": " + problem);
    }
    LOG.warn("jetstream source: stream '{}' at sequence {}: {}; starting a new consumer",
        opts.stream, next, problem);
    startConsumer();
  }

  /** A consumer from `next` on, with a delivery subject of its own; stale frames miss it. */
  private void startConsumer() throws IOException {
    dropConsumer();
    pulls.clear();
    lastPending = -1;
    uncappedNext = false;
    String name = "tf-read-" + UUID.randomUUID().toString().replace("-", "").substring(0, 16);
    ObjectNode config = MAPPER.createObjectNode();
    config.put("name", name);
    config.put("deliver_policy", "by_start_sequence");
    config.put("opt_start_seq", next);
    config.put("ack_policy", "none");
    config.put("mem_storage", true);
    config.put("num_replicas", 1);
    config.put("inactive_threshold", INACTIVE_NS);
    if (opts.subjects.size() == 1) {
      config.put("filter_subject", opts.subjects.get(0));
    } else if (!opts.subjects.isEmpty()) {
      config.putArray("filter_subjects").addAll(opts.subjects.stream()
          .map(MAPPER.getNodeFactory()::textNode).toList());
    }
    ObjectNode req = MAPPER.createObjectNode();
    req.put("stream_name", opts.stream);
    req.set("config", config);
    req.put("action", "create");
    JsonNode r = nc.request("$JS.API.CONSUMER.CREATE." + opts.stream + "." + name,
        MAPPER.writeValueAsBytes(req), timeoutNs);
    if (r.has("error")) {
      throw new SourceException("jetstream source: cannot read stream '" + opts.stream + "': "
          + r.get("error").path("description").asText());
    }
    consumer = name;
    consumers++;
    sid = nc.newSid();
    deliverSubject = nc.inbox + ".d" + sid;
    nc.subscribe(deliverSubject, sid);
    if (r.path("num_pending").asLong(0) == 0) {
      lastPending = 0;
      confirmEnd();
    }
  }

  private void dropConsumer() {
    if (consumer == null) {
      return;
    }
    String name = consumer;
    consumer = null;
    try { // the reply is not waited for; the inactive threshold removes it anyway
      nc.subscribe(null, sid);
      nc.publish("$JS.API.CONSUMER.DELETE." + opts.stream + "." + name, nc.inbox + ".r.0",
          new byte[0]);
    } catch (IOException ignored) {
      // the connection is dropped by the caller
    }
  }

  // a delivery's reply tokens, kept between messages: parsing allocates nothing
  private final long[] replyNums = new long[16];
  private final boolean[] replyNumeric = new boolean[16];
  private final int[] replyStarts = new int[16];
  private static final long NO_OVERFLOW = (Long.MAX_VALUE - 9) / 10; // v * 10 + 9 still fits
  // the reply's bytes before its numbers, the same for every delivery of one consumer
  private byte[] replyPrefix = new byte[0];
  private int replyTail;

  /** "$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>", or the v2 form
   * with domain and account hash after ACK and a token at the end. A reply that starts as
   * the last one did has only its numbers read. */
  private void parseReply(byte[] buf, int off, int len) throws IOException {
    int plen = replyPrefix.length;
    if (plen > 0 && len > plen && Arrays.equals(buf, off, off + plen, replyPrefix, 0, plen)
        && tokens(buf, off + plen, off + len) == replyTail && numbers(0)) {
      took(0);
      return;
    }
    int count = tokens(buf, off, off + len);
    int base;
    if (count == 9) {
      base = 4;
    } else if (count >= 11 && count <= 16) {
      base = 6;
    } else {
      throw new IOException("jetstream source: unexpected delivery reply "
          + new String(buf, off, len, StandardCharsets.UTF_8));
    }
    if (!numbers(base)) {
      throw new IOException("jetstream source: unexpected delivery reply "
          + new String(buf, off, len, StandardCharsets.UTF_8));
    }
    took(base);
    replyPrefix = Arrays.copyOfRange(buf, off, off + replyStarts[base]);
    replyTail = count - base;
  }

  /** The dot-separated tokens of buf[from, to): how many, each one's value when it is
   * digits (`replyNums`, `replyNumeric`) and its start from `from` (`replyStarts`). */
  private int tokens(byte[] buf, int from, int to) {
    long[] nums = replyNums;
    boolean[] numeric = replyNumeric;
    int count = 0;
    long v = 0;
    boolean digits = true;
    int tokStart = from;
    for (int i = from; i <= to; i++) {
      byte c = i < to ? buf[i] : (byte) '.';
      if (c == '.') {
        if (count < 16) {
          nums[count] = v;
          numeric[count] = digits && i > tokStart;
          replyStarts[count] = tokStart - from;
        }
        count++;
        v = 0;
        digits = true;
        tokStart = i + 1;
      } else if (c >= '0' && c <= '9' && v <= NO_OVERFLOW) {
        v = v * 10 + (c - '0');
      } else {
        digits = false;
      }
    }
    return count;
  }

  /** Whether the five tokens from `base` (delivered, stream seq, consumer seq, time,
   * pending) are numbers. */
  private boolean numbers(int base) {
    for (int k = base; k < base + 5; k++) {
      if (!replyNumeric[k]) {
        return false;
      }
    }
    return true;
  }

  private void took(int base) {
    seq = replyNums[base + 1];
    tsNanos = replyNums[base + 3];
    lastPending = replyNums[base + 4];
  }

  private static void sleep(long ms) {
    try {
      Thread.sleep(ms);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }

  @Override
  public void close() {
    dropConsumer();
  }
}
