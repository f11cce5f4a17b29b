package io.tierflow.jetstream;

import java.io.ByteArrayOutputStream;
import java.io.Closeable;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.net.SocketTimeoutException;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyFactory;
import java.security.KeyStore;
import java.security.PrivateKey;
import java.security.SecureRandom;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.security.spec.PKCS8EncodedKeySpec;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collection;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.net.ssl.KeyManagerFactory;
import javax.net.ssl.SSLContext;
import javax.net.ssl.SSLSocket;
import javax.net.ssl.TrustManagerFactory;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonGenerator;
import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;

/**
 * One NATS connection with what reading a JetStream range takes: publishes, a request inbox
 * and subscriptions by sid, and frames read on the caller's thread.
 *
 * <p>Hand-written because the Java NATS client (jnats) is neither among Spark's jars nor on
 * the registries tierflow installs from; what it speaks is the text protocol nats-server
 * documents (INFO, CONNECT, PUB, SUB, UNSUB, MSG, HMSG, PING/PONG). A frame's fields point into the
 * read buffer and stay valid until the next {@link #next} call, so a delivery is copied once,
 * into its row. Plain TCP or TLS (server-verified, with a client certificate when given), a
 * token or a user and password; credentials files and WebSocket URLs are left to the Python
 * source (`jobs.jvm_source.speaks` decides).
 */
final class NatsConnection implements Closeable {
  static final int FRAME_MSG = 1;
  static final int FRAME_OTHER = 0;

  private static final JsonFactory JSON = new JsonFactory();
  private static final ObjectMapper MAPPER = new ObjectMapper();
  private static final Pattern MAX_PAYLOAD = Pattern.compile("\"max_payload\"\\s*:\\s*(\\d+)");
  private static final int MAX_LINE = 1 << 16;
  private static final Pattern TLS_REQUIRED = Pattern.compile("\"tls_required\"\\s*:\\s*true");

  final String inbox;
  final long maxPayload;
  private final Socket socket;
  private final InputStream in;
  private final OutputStream out;
  private byte[] buf = new byte[1 << 20];
  private int pos;
  private int lim;
  private boolean broken;
  private boolean inBody; // `next` has taken a message's line and waits for its body
  private int requestId;
  private int lastSid = 1;

  // the frame `next` read last: offsets into `buf`; headers -1 when the message has none
  int sid;
  int subjectOff;
  int subjectLen;
  int replyOff;
  int replyLen;
  int headerOff;
  int headerLen;
  int dataOff;
  int dataLen;

  NatsConnection(Endpoint ep, String url, int timeoutMs) throws IOException {
    URI uri = URI.create(url.contains("://") ? url : "nats://" + url);
    int port = uri.getPort() > 0 ? uri.getPort() : 4222;
    Socket plain = new Socket();
    plain.setTcpNoDelay(true);
    plain.setReceiveBufferSize(1 << 20);
    plain.connect(new InetSocketAddress(uri.getHost(), port), timeoutMs);
    plain.setSoTimeout(timeoutMs);
    Socket s = plain;
    try {
      InputStream pin = plain.getInputStream();
      String info = readLine(pin);
      if (!info.startsWith("INFO ")) {
        throw new IOException("nats: expected INFO from " + url + ", got " + clip(info));
      }
      boolean tls = "tls".equals(uri.getScheme()) || ep.tlsCa != null || ep.tlsCert != null
          || TLS_REQUIRED.matcher(info).find();
      if (tls) {
        SSLSocket ssl = (SSLSocket) sslContext(ep).getSocketFactory()
            .createSocket(plain, uri.getHost(), port, true);
        ssl.setUseClientMode(true);
        javax.net.ssl.SSLParameters params = ssl.getSSLParameters();
        params.setEndpointIdentificationAlgorithm("HTTPS");
        ssl.setSSLParameters(params);
        ssl.startHandshake();
        s = ssl;
      }
      Matcher m = MAX_PAYLOAD.matcher(info);
      maxPayload = m.find() ? Long.parseLong(m.group(1)) : 1 << 20;
      socket = s;
      in = s.getInputStream();
      out = new java.io.BufferedOutputStream(s.getOutputStream(), 1 << 16);
      inbox = "_INBOX." + Long.toHexString(new SecureRandom().nextLong() & Long.MAX_VALUE);
      out.write(("CONNECT " + connectJson(ep, tls) + "\r\nPING\r\n").getBytes(StandardCharsets.UTF_8));
      out.flush();
      expectPong();
      out.write(("SUB " + inbox + ".r.* 1\r\n").getBytes(StandardCharsets.US_ASCII));
      out.flush();
    } catch (IOException | RuntimeException e) {
      plain.close();
      throw e;
    }
  }

  /** A subscription id never used on this connection (1 is the request inbox). */
  int newSid() {
    return ++lastSid;
  }

  /** Subscribes `subject` as `sid` (2 and up: 1 is the request inbox), or unsubscribes it. */
  void subscribe(String subject, int sid) throws IOException {
    write(subject == null ? "UNSUB " + sid + "\r\n" : "SUB " + subject + " " + sid + "\r\n");
  }

  private void write(String line) throws IOException {
    try {
      out.write(line.getBytes(StandardCharsets.UTF_8));
      out.flush();
    } catch (IOException e) {
      broken = true;
      throw e;
    }
  }

  /** A JetStream API request and its JSON answer; other frames meanwhile are skipped. */
  JsonNode request(String subject, byte[] body, long timeoutNs) throws IOException {
    String reply = inbox + ".r." + (++requestId);
    publish(subject, reply, body);
    byte[] want = reply.getBytes(StandardCharsets.US_ASCII);
    long deadline = System.nanoTime() + timeoutNs;
    while (true) {
      if (next(deadline) != FRAME_MSG || sid != 1 || subjectLen != want.length) {
        continue;
      }
      boolean same = true;
      for (int i = 0; i < want.length && same; i++) {
        same = buf[subjectOff + i] == want[i];
      }
      if (!same) {
        continue; // the answer to a request given up on, or to a consumer's delete
      }
      if (headerOff >= 0 && dataLen == 0
          && new String(buf, headerOff, headerLen, StandardCharsets.UTF_8).startsWith("NATS/1.0 503")) {
        throw new SourceException("jetstream source: JetStream is not answering " + subject
            + " (no responders)");
      }
      return MAPPER.readTree(buf, dataOff, dataLen);
    }
  }

  boolean healthy() {
    return !broken && !socket.isClosed();
  }

  /** Sends one message; flushed at once, so a pull request is in flight when this returns. */
  void publish(String subject, String reply, byte[] body) throws IOException {
    try {
      String head = "PUB " + subject + (reply == null ? "" : " " + reply) + " " + body.length + "\r\n";
      out.write(head.getBytes(StandardCharsets.UTF_8));
      out.write(body);
      out.write('\r');
      out.write('\n');
      out.flush();
    } catch (IOException e) {
      broken = true;
      throw e;
    }
  }

  /**
   * Reads the next frame; answers the server's pings on the way. FRAME_MSG for a message on
   * the inbox (fields set), FRAME_OTHER for anything else. Waits at most until
   * `deadlineNanos` (System.nanoTime): then SocketTimeoutException when no byte of a frame
   * came (the connection stays usable), or an IOException that marks it broken when a frame
   * was cut off.
   */
  int next(long deadlineNanos) throws IOException {
    try {
      int eol = lineEnd(deadlineNanos);
      int start = pos;
      pos = eol + 2;
      byte c0 = buf[start];
      if (c0 == 'M' || c0 == 'H') {
        return message(start, eol, c0 == 'H', deadlineNanos);
      }
      if (c0 == 'P' && eol - start == 4 && buf[start + 1] == 'I') { // PING
        out.write("PONG\r\n".getBytes(StandardCharsets.US_ASCII));
        out.flush();
      } else if (c0 == '-') {
        broken = true;
        throw new IOException("nats: " + new String(buf, start, eol - start, StandardCharsets.UTF_8));
      }
      return FRAME_OTHER;
    } catch (SocketTimeoutException e) {
      if (!inBody && pos == lim) {
        throw e; // no byte of a frame read: the connection is as it was
      }
      broken = true; // a frame cut off: what follows on this connection cannot be parsed
      throw new IOException("nats: timed out inside a frame", e);
    } catch (IOException e) {
      broken = true;
      throw e;
    } finally {
      inBody = false;
    }
  }

  /** "MSG subject sid [reply] size" or "HMSG subject sid [reply] hsize tsize", then the body. */
  private int message(int start, int eol, boolean headers, long deadlineNanos) throws IOException {
    int[] tok = new int[12]; // (offset from the line's start, length) of up to 6 tokens
    int n = 0;
    int i = start;
    while (i < eol && n < 12) {
      while (i < eol && buf[i] == ' ') {
        i++;
      }
      int t = i;
      while (i < eol && buf[i] != ' ') {
        i++;
      }
      if (i > t) {
        tok[n++] = t - start;
        tok[n++] = i - t;
      }
    }
    int fields = n / 2;
    int sizes = headers ? 2 : 1;
    if (i < eol || (fields != 3 + sizes && fields != 4 + sizes)) {
      throw new IOException("nats: bad message line "
          + clip(new String(buf, start, eol - start, StandardCharsets.UTF_8)));
    }
    int total = number(start + tok[2 * (fields - 1)], tok[2 * (fields - 1) + 1]);
    int hsize = headers ? number(start + tok[2 * (fields - 2)], tok[2 * (fields - 2) + 1]) : 0;
    if (hsize > total) {
      throw new IOException("nats: header size past the message's size");
    }
    int lineLen = eol + 2 - start;
    inBody = true;
    start = ensure(start, lineLen + total + 2, deadlineNanos);
    sid = number(start + tok[4], tok[5]);
    subjectOff = start + tok[2];
    subjectLen = tok[3];
    boolean hasReply = fields == 4 + sizes;
    replyOff = hasReply ? start + tok[6] : 0;
    replyLen = hasReply ? tok[7] : 0;
    int body = start + lineLen;
    headerOff = headers ? body : -1;
    headerLen = hsize;
    dataOff = body + hsize;
    dataLen = total - hsize;
    pos = body + total + 2;
    return FRAME_MSG;
  }

  /**
   * Makes `buf[start .. start + need)` hold bytes read from the stream and returns where
   * `start` is now: unread bytes move to the front when the buffer's end is near, and the
   * buffer grows for a frame bigger than it.
   */
  private int ensure(int start, int need, long deadlineNanos) throws IOException {
    if (start + need <= lim) {
      return start;
    }
    if (start + need > buf.length) {
      byte[] dst = need > buf.length ? new byte[Math.max(need, buf.length * 2)] : buf;
      System.arraycopy(buf, start, dst, 0, lim - start);
      buf = dst;
      lim -= start;
      pos -= start;
      start = 0;
    }
    while (start + need > lim) {
      read(deadlineNanos);
    }
    return start;
  }

  private void read(long deadlineNanos) throws IOException {
    long left = (deadlineNanos - System.nanoTime()) / 1_000_000L;
    if (left <= 0) {
      throw new SocketTimeoutException("nats: no answer in time");
    }
    socket.setSoTimeout((int) Math.min(Integer.MAX_VALUE, Math.max(1, left)));
    int r = in.read(buf, lim, buf.length - lim);
    if (r < 0) {
      throw new IOException("nats: connection closed by the server");
    }
    lim += r;
  }

  /** The index of the next CRLF at or after `pos` (which may move), reading more as needed. */
  private int lineEnd(long deadlineNanos) throws IOException {
    int scanned = 0; // bytes after pos already looked at
    while (true) {
      for (int i = pos + scanned; i + 1 < lim; i++) {
        if (buf[i] == '\r' && buf[i + 1] == '\n') {
          return i;
        }
      }
      scanned = Math.max(0, lim - 1 - pos);
      if (scanned > MAX_LINE) {
        throw new IOException("nats: protocol line longer than " + MAX_LINE + " bytes");
      }
      pos = ensure(pos, lim - pos + 1, deadlineNanos);
    }
  }

  private int number(int off, int len) throws IOException {
    if (len == 0 || len > 9) {
      throw new IOException("nats: bad size in a message line");
    }
    int v = 0;
    for (int i = off; i < off + len; i++) {
      int d = buf[i] - '0';
      if (d < 0 || d > 9) {
        throw new IOException("nats: bad size in a message line");
      }
      v = v * 10 + d;
    }
    return v;
  }

  byte[] buffer() {
    return buf;
  }

  private void expectPong() throws IOException {
    long deadline = System.nanoTime() + 10_000_000_000L;
    while (true) {
      int eol = lineEnd(deadline);
      String line = new String(buf, pos, eol - pos, StandardCharsets.UTF_8);
      pos = eol + 2;
      if (line.equals("PONG")) {
        return;
      }
      if (line.startsWith("-ERR")) {
        throw new IOException("nats: connect refused: " + line);
      }
    }
  }

  @Override
  public void close() {
    broken = true;
    try {
      socket.close();
    } catch (IOException ignored) {
      // closing is best effort
    }
  }

  private static String connectJson(Endpoint ep, boolean tls) throws IOException {
    ByteArrayOutputStream bytes = new ByteArrayOutputStream();
    try (JsonGenerator g = JSON.createGenerator(bytes)) {
      g.writeStartObject();
      g.writeBooleanField("verbose", false);
      g.writeBooleanField("pedantic", false);
      g.writeBooleanField("tls_required", tls);
      g.writeStringField("name", "tierflow-jvm-source");
      g.writeStringField("lang", "java");
      g.writeStringField("version", "1");
      g.writeNumberField("protocol", 1);
      g.writeBooleanField("headers", true);
      g.writeBooleanField("no_responders", true);
      if (ep.token != null) {
        g.writeStringField("auth_token", ep.token);
      }
      if (ep.user != null) {
        g.writeStringField("user", ep.user);
        g.writeStringField("pass", ep.password == null ? "" : ep.password);
      }
      g.writeEndObject();
    }
    return bytes.toString(StandardCharsets.UTF_8);
  }

  private static String readLine(InputStream in) throws IOException {
    ByteArrayOutputStream line = new ByteArrayOutputStream();
    for (int i = 0; i < 1 << 16; i++) {
      int b = in.read();
      if (b < 0) {
        throw new IOException("nats: connection closed before INFO");
      }
      if (b == '\n') {
        String s = line.toString(StandardCharsets.UTF_8);
        return s.endsWith("\r") ? s.substring(0, s.length() - 1) : s;
      }
      line.write(b);
    }
    throw new IOException("nats: INFO line too long");
  }

  private static String clip(String s) {
    return s.length() > 200 ? s.substring(0, 200) + "..." : s;
  }

  private static SSLContext sslContext(Endpoint ep) throws IOException {
    try {
      TrustManagerFactory tmf = null;
      if (ep.tlsCa != null) {
        KeyStore trust = KeyStore.getInstance(KeyStore.getDefaultType());
        trust.load(null, null);
        int i = 0;
        for (Certificate c : certificates(ep.tlsCa)) {
          trust.setCertificateEntry("ca" + i++, c);
        }
        tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        tmf.init(trust);
      }
      KeyManagerFactory kmf = null;
      if (ep.tlsCert != null && ep.tlsKey != null) {
        KeyStore keys = KeyStore.getInstance(KeyStore.getDefaultType());
        keys.load(null, null);
        char[] none = new char[0];
        keys.setKeyEntry("client", privateKey(ep.tlsKey), none,
            certificates(ep.tlsCert).toArray(new Certificate[0]));
        kmf = KeyManagerFactory.getInstance(KeyManagerFactory.getDefaultAlgorithm());
        kmf.init(keys, none);
      }
      SSLContext ctx = SSLContext.getInstance("TLS");
      ctx.init(kmf == null ? null : kmf.getKeyManagers(), tmf == null ? null : tmf.getTrustManagers(), null);
      return ctx;
    } catch (IOException e) {
      throw e;
    } catch (Exception e) {
      throw new IOException("nats: TLS setup: " + e, e);
    }
  }

  private static Collection<? extends Certificate> certificates(String path) throws Exception {
    try (InputStream f = Files.newInputStream(Path.of(path))) {
      return CertificateFactory.getInstance("X.509").generateCertificates(f);
    }
  }

  private static PrivateKey privateKey(String path) throws Exception {
    String pem = Files.readString(Path.of(path));
    if (!pem.contains("BEGIN PRIVATE KEY")) {
      throw new IOException("nats: " + path + " is not a PKCS#8 PEM key (BEGIN PRIVATE KEY)");
    }
    String body = pem.replaceAll("-----[A-Z ]+-----", "").replaceAll("\\s", "");
    PKCS8EncodedKeySpec spec = new PKCS8EncodedKeySpec(Base64.getDecoder().decode(body));
    List<String> algs = new ArrayList<>(List.of("EC", "RSA", "Ed25519"));
    Exception last = null;
    for (String alg : algs) {
      try {
        return KeyFactory.getInstance(alg).generatePrivate(spec);
      } catch (Exception e) {
        last = e;
      }
    }
    throw new IOException("nats: cannot read key " + path + ": " + last);
  }

}
