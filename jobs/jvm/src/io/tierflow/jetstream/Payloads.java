package io.tierflow.jetstream;

import java.lang.invoke.MethodHandles;
import java.lang.invoke.VarHandle;
import java.nio.ByteOrder;

/**
 * Whether an event's payload is well formed: `jobs.jetstream_read.check_payload`'s rule
 * (UTF-8, then one JSON document) in its words, so a dead-letter reason reads the same from
 * either source: CPython's UTF-8 decoder's error (`utf8Reason`) and msgspec's JSON one
 * (`JsonCheck`).
 */
final class Payloads {
  static final String NOT_UTF8 = "payload is not UTF-8";
  static final String NOT_JSON = "payload is not JSON";

  /** Eight bytes at a time, for runs of plain ASCII (most of an event). */
  private static final VarHandle LONGS =
      MethodHandles.byteArrayViewVarHandle(long[].class, ByteOrder.LITTLE_ENDIAN);
  private static final long HIGH_BITS = 0x8080808080808080L;

  private Payloads() {}

  /** Why the payload is malformed, or null. */
  static String error(byte[] b, int off, int len, String validate) {
    if (validate.equals("none")) {
      return null;
    }
    if (utf8Error(b, off, len) >= 0) {
      return NOT_UTF8 + ": " + utf8Reason(b, off, len);
    }
    if (validate.equals("json")) {
      String why = JsonCheck.error(b, off, len);
      return why == null ? null : NOT_JSON + ": " + why;
    }
    return null;
  }

  /** The position of the first byte that is not well-formed UTF-8 (RFC 3629), or -1. */
  static int utf8Error(byte[] b, int off, int len) {
    int i = off;
    int end = off + len;
    while (i < end) {
      if (end - i >= 8 && ((long) LONGS.get(b, i) & HIGH_BITS) == 0) {
        i += 8;
        continue;
      }
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

  private static boolean cont(byte[] b, int i) {
    return (b[i] & 0xc0) == 0x80;
  }

  private static final String[] WHY = {
    "invalid start byte", "invalid continuation byte", "unexpected end of data"};
  private static final byte[] REPLACEMENT = {(byte) 0xef, (byte) 0xbf, (byte) 0xbd};

  /**
   * CPython's UTF-8 decoder (Objects/stringlib/codecs.h) at `s`, a byte from 0x80: the length
   * of the well-formed sequence there, or, for a fault, `-(reason * 8 + span)` with `span`
   * the bytes the fault covers (a sequence cut short at the end spans to the end; a bad
   * continuation spans the bytes before it) and `reason` an index into `WHY`.
   */
  private static int sequence(byte[] b, int s, int end) {
    int ch = b[s] & 0xff;
    int left = end - s;
    if (ch < 0xc2 || ch >= 0xf5) {
      return -(0 * 8 + 1);
    }
    if (ch < 0xe0) {
      if (left < 2) {
        return -(2 * 8 + left);
      }
      return cont(b, s + 1) ? 2 : -(1 * 8 + 1);
    }
    int c2 = left >= 2 ? b[s + 1] & 0xff : 0;
    if (ch < 0xf0) {
      boolean bad2 = left >= 2 && (!cont(b, s + 1) || (c2 < 0xa0 ? ch == 0xe0 : ch == 0xed));
      if (bad2) {
        return -(1 * 8 + 1);
      }
      if (left < 3) {
        return -(2 * 8 + left);
      }
      return cont(b, s + 2) ? 3 : -(1 * 8 + 2);
    }
    if (left >= 2 && (!cont(b, s + 1) || (c2 < 0x90 ? ch == 0xf0 : ch == 0xf4))) {
      return -(1 * 8 + 1);
    }
    if (left >= 3 && !cont(b, s + 2)) {
      return -(1 * 8 + 2);
    }
    if (left < 4) {
      return -(2 * 8 + left);
    }
    return cont(b, s + 3) ? 4 : -(1 * 8 + 3);
  }

  /** Where the next fault at or after `from` starts (`sequence` there says what), or -1. */
  private static int nextFault(byte[] b, int from, int end) {
    for (int s = from; s < end; ) {
      if ((b[s] & 0x80) == 0) {
        s++;
        continue;
      }
      int n = sequence(b, s, end);
      if (n < 0) {
        return s;
      }
      s += n;
    }
    return -1;
  }

  /** `str(UnicodeDecodeError)` of `bytes.decode("utf-8")`, for bytes that are not UTF-8. */
  static String utf8Reason(byte[] b, int off, int len) {
    int s = nextFault(b, off, off + len);
    if (s < 0) {
      return null;
    }
    int n = -sequence(b, s, off + len);
    int span = n % 8;
    int at = s - off;
    if (span == 1) {
      return String.format("'utf-8' codec can't decode byte 0x%02x in position %d: %s",
          b[s] & 0xff, at, WHY[n / 8]);
    }
    return "'utf-8' codec can't decode bytes in position " + at + "-" + (at + span - 1) + ": "
        + WHY[n / 8];
  }

  /** `bytes.decode("utf-8", "replace")` as UTF-8 bytes: one U+FFFD for each fault's span. */
  static byte[] replaceInvalid(byte[] b, int off, int len) {
    java.io.ByteArrayOutputStream out = new java.io.ByteArrayOutputStream(len + 8);
    int end = off + len;
    int from = off;
    for (int s; (s = nextFault(b, from, end)) >= 0; ) {
      out.write(b, from, s - from);
      out.write(REPLACEMENT, 0, REPLACEMENT.length);
      from = s + (-sequence(b, s, end)) % 8;
    }
    out.write(b, from, end - from);
    return out.toByteArray();
  }
}
