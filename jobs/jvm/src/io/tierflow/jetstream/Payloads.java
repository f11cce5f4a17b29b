package io.tierflow.jetstream;

import java.io.IOException;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.core.StreamReadConstraints;
import com.fasterxml.jackson.core.StreamReadFeature;

/**
 * Whether an event's payload is well formed: `jobs.jetstream_read.check_payload`'s rule
 * (UTF-8, then one JSON document) and the same first words of its error, so a dead-letter
 * reason reads the same from either source.
 */
final class Payloads {
  // an event may be as big as the server's max_payload: no limit on a string's length
  private static final JsonFactory JSON = JsonFactory.builder()
      .disable(StreamReadFeature.INCLUDE_SOURCE_IN_LOCATION)
      .streamReadConstraints(StreamReadConstraints.builder()
          .maxStringLength(Integer.MAX_VALUE).maxNumberLength(Integer.MAX_VALUE).build())
      .build();

  static final String NOT_UTF8 = "payload is not UTF-8";

  private Payloads() {}

  /** Why the payload is malformed, or null. */
  static String error(byte[] b, int off, int len, String validate) {
    if (validate.equals("none")) {
      return null;
    }
    int bad = utf8Error(b, off, len);
    if (bad >= 0) {
      return NOT_UTF8 + ": invalid byte 0x" + String.format("%02x", b[off + bad] & 0xff)
          + " in position " + bad;
    }
    if (validate.equals("json")) {
      return jsonError(b, off, len);
    }
    return null;
  }

  /** The position of the first byte that is not well-formed UTF-8 (RFC 3629), or -1. */
  static int utf8Error(byte[] b, int off, int len) {
    int i = off;
    int end = off + len;
    while (i < end) {
      int c = b[i] & 0xff;
      if (c < 0x80) {
        i++;
        continue;
      }
      int n;
      int min;
      if (c >= 0xc2 && c <= 0xdf) {
        n = 1;
        min = 0x80;
      } else if (c >= 0xe0 && c <= 0xef) {
        n = 2;
        min = 0x800;
      } else if (c >= 0xf0 && c <= 0xf4) {
        n = 3;
        min = 0x10000;
      } else {
        return i - off;
      }
      if (i + n >= end) {
        return i - off; // cut short
      }
      int cp = c & (0x3f >> n);
      for (int k = 1; k <= n; k++) {
        int cc = b[i + k] & 0xff;
        if ((cc & 0xc0) != 0x80) {
          return i - off;
        }
        cp = (cp << 6) | (cc & 0x3f);
      }
      if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
        return i - off;
      }
      i += n + 1;
    }
    return -1;
  }

  /** Null when the bytes are exactly one JSON document (whitespace around it allowed). */
  static String jsonError(byte[] b, int off, int len) {
    try (JsonParser p = JSON.createParser(b, off, len)) {
      if (p.nextToken() == null) {
        return "payload is not JSON: Input data was truncated";
      }
      p.skipChildren();
      JsonToken after = p.nextToken();
      if (after != null) {
        return "payload is not JSON: trailing characters after the document";
      }
      return null;
    } catch (IOException e) {
      String m = e.getMessage();
      int cut = m == null ? -1 : m.indexOf('\n');
      return "payload is not JSON: " + (cut > 0 ? m.substring(0, cut) : m);
    }
  }
}
