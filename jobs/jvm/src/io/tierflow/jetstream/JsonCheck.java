package io.tierflow.jetstream;

/**
 * Whether bytes are exactly one JSON document, with the answer the Python source gives:
 * msgspec's JSON skip (`json_skip` in msgspec's _core.c, which `msgspec.Raw` decoding runs),
 * step for step, so an error names the same fault at the same byte ("JSON is malformed:
 * expected ':' (byte 5)", "Input data was truncated"), plus tierflow's nesting limit
 * (`runtime.data.json_depth`), which msgspec leaves to Python's recursion limit.
 *
 * Hand-written rather than Jackson: Jackson words its errors differently, and a parser per
 * event allocated more than the whole rest of the read. This one allocates nothing unless
 * the payload is malformed.
 */
final class JsonCheck {
  /** `runtime.data.json_depth.MAX_DEPTH`. */
  static final int MAX_DEPTH = 512;
  static final String TRUNCATED = "Input data was truncated";
  /** Bytes that end a run of string content: `"`, `\\` and the control bytes. */
  private static final boolean[] SPECIAL = new boolean[256];

  static {
    for (int c = 0; c < 0x20; c++) {
      SPECIAL[c] = true;
    }
    SPECIAL['"'] = true;
    SPECIAL['\\'] = true;
  }

  private final byte[] b;
  private final int start;
  private final int end;
  private int pos;
  private String error;

  private JsonCheck(byte[] b, int off, int len) {
    this.b = b;
    this.start = off;
    this.end = off + len;
    this.pos = off;
  }

  /** Null when `b[off, off+len)` is one JSON document (whitespace around it allowed), else
   * msgspec's words for why not. */
  static String error(byte[] b, int off, int len) {
    JsonCheck c = new JsonCheck(b, off, len);
    if (c.skipWsTruncated() && c.skip(0)) {
      c.trailing();
    }
    return c.error;
  }

  private boolean truncated() {
    error = TRUNCATED;
    return false;
  }

  private boolean invalid(String what) {
    error = "JSON is malformed: " + what + " (byte " + (pos - start) + ")";
    return false;
  }

  private static boolean ws(int c) {
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
  }

  /** `json_peek_skip_ws`: false (truncated) at the end of input. */
  private boolean skipWsTruncated() {
    while (pos < end && ws(b[pos])) {
      pos++;
    }
    return pos < end || truncated();
  }

  private int peekOrNull() {
    return pos < end ? b[pos] & 0xff : 0;
  }

  private void trailing() {
    while (pos < end) {
      int c = b[pos++];
      if (!ws(c)) {
        invalid("trailing characters");
        return;
      }
    }
  }

  private boolean skip(int depth) {
    if (!skipWsTruncated()) {
      return false;
    }
    switch (b[pos]) {
      case 'n':
        return ident("ull");
      case 't':
        return ident("rue");
      case 'f':
        return ident("alse");
      case '"':
        return string();
      case '[':
        return array(depth + 1);
      case '{':
        return object(depth + 1);
      default:
        return number();
    }
  }

  private boolean ident(String rest) {
    pos++;
    if (end - pos < rest.length()) {
      return truncated();
    }
    for (int i = 0; i < rest.length(); i++) {
      if (b[pos + i] != rest.charAt(i)) {
        return invalid("invalid character");
      }
    }
    pos += rest.length();
    return true;
  }

  private boolean deeper(int depth) {
    if (depth <= MAX_DEPTH) {
      return true;
    }
    error = "JSON is malformed: nested deeper than " + MAX_DEPTH + " levels (byte "
        + (pos - start) + ")";
    return false;
  }

  private static final int CLOSED = -2;
  private static final int FAILED = -1;

  /** The first byte of a container's next member (0-255), `CLOSED` past its closing
   * bracket, or `FAILED` with the error set: msgspec's loop head, shared by arrays and
   * objects. */
  private int member(char close, boolean first) {
    if (!skipWsTruncated()) {
      return FAILED;
    }
    int c = b[pos] & 0xff;
    if (c == close) {
      pos++;
      return CLOSED;
    }
    if (c == ',' && !first) {
      pos++;
      return skipWsTruncated() ? b[pos] & 0xff : FAILED;
    }
    if (first) {
      return c;
    }
    invalid("expected ',' or '" + close + "'");
    return FAILED;
  }

  private boolean array(int depth) {
    if (!deeper(depth)) {
      return false;
    }
    pos++;
    for (boolean first = true; ; first = false) {
      int c = member(']', first);
      if (c == CLOSED) {
        return true;
      }
      if (c == FAILED) {
        return false;
      }
      if (c == ']') {
        return invalid("trailing comma in array");
      }
      if (!skip(depth)) {
        return false;
      }
    }
  }

  private boolean object(int depth) {
    if (!deeper(depth)) {
      return false;
    }
    pos++;
    for (boolean first = true; ; first = false) {
      int c = member('}', first);
      if (c == CLOSED) {
        return true;
      }
      if (c == FAILED) {
        return false;
      }
      if (c == '}') {
        return invalid("trailing comma in object");
      }
      if (c != '"') {
        return invalid("expected '\"'");
      }
      if (!string()) {
        return false;
      }
      if (!skipWsTruncated()) {
        return false;
      }
      if (b[pos] != ':') {
        return invalid("expected ':'");
      }
      pos++;
      if (!skip(depth)) {
        return false;
      }
    }
  }

  private static boolean digit(int c) {
    return c >= '0' && c <= '9';
  }

  /** `json_maybe_skip_number`: called with at least one byte left. */
  private boolean number() {
    int c = b[pos] & 0xff;
    if (c == '-') {
      pos++;
      c = peekOrNull();
    }
    if (c == '0') {
      pos++;
      if (digit(peekOrNull())) {
        return invalid("invalid number");
      }
    } else {
      int from = pos;
      while (pos < end && digit(b[pos])) {
        pos++;
      }
      if (from == pos) {
        return invalid("invalid character");
      }
    }
    c = peekOrNull();
    if (c == '.') {
      pos++;
      int from = pos;
      while (pos < end && digit(b[pos])) {
        pos++;
      }
      if (from == pos) {
        return invalid("invalid number");
      }
      c = peekOrNull();
    }
    if (c == 'e' || c == 'E') {
      pos++;
      c = peekOrNull();
      if (c == '+' || c == '-') {
        pos++;
      }
      int from = pos;
      while (pos < end && digit(b[pos])) {
        pos++;
      }
      if (from == pos) {
        return invalid("invalid number");
      }
    }
    return true;
  }

  /** `json_skip_string`: from the opening quote; control bytes are refused, escapes checked
   * (a \\u surrogate must be a pair). UTF-8 is checked before this runs. */
  private boolean string() {
    pos++;
    final byte[] buf = b;
    final int stop = end;
    while (true) {
      int p = pos;
      while (p < stop && !SPECIAL[buf[p] & 0xff]) {
        p++;
      }
      pos = p;
      if (p == stop) {
        return truncated();
      }
      int c = buf[p];
      if (c == '"') {
        pos++;
        return true;
      }
      if (c != '\\') {
        return invalid("invalid character");
      }
      pos++;
      if (pos == end) {
        return truncated();
      }
      switch (b[pos]) {
        case '"':
        case '\\':
        case '/':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          pos++;
          break;
        case 'u': {
          pos++;
          int cp = codepoint();
          if (cp < 0) {
            return false;
          }
          if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return invalid("invalid utf-16 surrogate pair");
          }
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (end - pos < 6) {
              return truncated();
            }
            if (b[pos] != '\\' || b[pos + 1] != 'u') {
              return invalid("unexpected end of hex escape");
            }
            pos += 2;
            int cp2 = codepoint();
            if (cp2 < 0) {
              return false;
            }
            if (cp2 < 0xDC00 || cp2 > 0xDFFF) {
              return invalid("invalid utf-16 surrogate pair");
            }
          }
          break;
        }
        default:
          return invalid("invalid escaped character");
      }
    }
  }

  /** `json_read_codepoint`: four hex digits, or -1 with the error set. */
  private int codepoint() {
    if (end - pos < 4) {
      truncated();
      return -1;
    }
    int cp = 0;
    for (int i = 0; i < 4; i++) {
      int c = b[pos++];
      int v;
      if (c >= '0' && c <= '9') {
        v = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        v = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        v = c - 'A' + 10;
      } else {
        invalid("invalid character in unicode escape");
        return -1;
      }
      cp = (cp << 4) + v;
    }
    return cp;
  }
}
