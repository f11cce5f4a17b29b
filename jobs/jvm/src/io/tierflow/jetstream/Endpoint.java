package io.tierflow.jetstream;

import java.io.IOException;
import java.io.Serializable;
import java.util.Map;
import java.util.Objects;

/**
 * Where and as whom to connect: the jetstream source's connection options, the same keys as
 * `runtime.nats.endpoint.NatsEndpoint.to_options` writes. Equal endpoints share pooled
 * connections.
 */
final class Endpoint implements Serializable {
  private static final long serialVersionUID = 1L;

  final String url;
  final String user;
  final String password;
  final String token;
  final String creds;
  final String tlsCa;
  final String tlsCert;
  final String tlsKey;

  Endpoint(Map<String, String> options) {
    url = Objects.requireNonNull(blank(options.get("url")), "option 'url' is required");
    user = blank(options.get("user"));
    password = blank(options.get("password"));
    token = blank(options.get("token"));
    creds = blank(options.get("creds"));
    tlsCa = blank(options.get("tlsca"));
    tlsCert = blank(options.get("tlscert"));
    tlsKey = blank(options.get("tlskey"));
  }

  /** A connection to the first server of the URL list that answers. */
  NatsConnection connect(int timeoutMs) throws IOException {
    IOException last = null;
    for (String u : url.split(",")) {
      String one = u.trim();
      if (one.isEmpty()) {
        continue;
      }
      try {
        return new NatsConnection(this, one, timeoutMs);
      } catch (IOException e) {
        last = e;
      }
    }
    throw last != null ? last : new IOException("nats: no URL in " + url);
  }

  private static String blank(String v) {
    return v == null || v.isEmpty() ? null : v;
  }

  private Object[] key() {
    return new Object[] {url, user, password, token, creds, tlsCa, tlsCert, tlsKey};
  }

  @Override
  public boolean equals(Object o) {
    return o instanceof Endpoint && java.util.Arrays.equals(key(), ((Endpoint) o).key());
  }

  @Override
  public int hashCode() {
    return java.util.Arrays.hashCode(key());
  }
}
