package io.tierflow.jetstream;

import java.nio.charset.StandardCharsets;

import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;

/**
 * An event's fields, read into column vectors while its bytes are at hand, so that Spark's
 * `from_json` (Jackson, a parser and a row per event) runs only for the events this cannot
 * read as it would.
 *
 * Only the plain shape is read here: a JSON object whose declared fields are BIGINT, INT,
 * DOUBLE, BOOLEAN or STRING, each a value of its own kind (an integer in range, any number
 * for a DOUBLE, a boolean, a string without escapes) or null, no key twice. For anything else (a string for
 * a number, a non-string for a STRING, an escape, a repeated key, a key that differs from a
 * field only in case, a number Jackson would read otherwise) `parse` answers false, and
 * the query takes Spark's own `from_json` for that event: the answer is always Spark's.
 * The events reach it already checked as JSON (the source's `validate=json`).
 *
 * Hand-written: no JSON library writes into Spark's column vectors, and the event's bytes
 * are walked once more at most, allocating nothing.
 */
final class FieldParser {
  private static final int LONG = 0;
  private static final int INT = 1;
  private static final int DOUBLE = 2;
  private static final int BOOLEAN = 3;
  private static final int STRING = 4;

  private final byte[][] names;
  private final String[] lowerNames;
  private final int[] kinds;
  private final boolean[] seen;

  private FieldParser(StructType schema) {
    StructField[] fields = schema.fields();
    names = new byte[fields.length][];
    lowerNames = new String[fields.length];
    kinds = new int[fields.length];
    seen = new boolean[fields.length];
    for (int i = 0; i < fields.length; i++) {
      names[i] = fields[i].name().getBytes(StandardCharsets.UTF_8);
      lowerNames[i] = fields[i].name().toLowerCase(java.util.Locale.ROOT);
      kinds[i] = kind(fields[i].dataType());
    }
  }

  /** A parser for `schema`, or null when a field's type is not one read here. */
  static FieldParser of(StructType schema) {
    if (schema.fields().length == 0) {
      return null;
    }
    for (StructField f : schema.fields()) {
      if (kind(f.dataType()) < 0) {
        return null;
      }
    }
    return new FieldParser(schema);
  }

  private static int kind(DataType t) {
    if (t.equals(DataTypes.LongType)) {
      return LONG;
    }
    if (t.equals(DataTypes.IntegerType)) {
      return INT;
    }
    if (t.equals(DataTypes.DoubleType)) {
      return DOUBLE;
    }
    if (t.equals(DataTypes.BooleanType)) {
      return BOOLEAN;
    }
    if (t.equals(DataTypes.StringType)) {
      return STRING;
    }
    return -1;
  }

  /**
   * Row `row` of `cols[base + i]` (field i) from the JSON object `b[off, off+len)`; false
   * when Spark's `from_json` must read this event instead (the row's fields are then null).
   */
  boolean parse(byte[] b, int off, int len, OnHeapColumnVector[] cols, int base, int row) {
    java.util.Arrays.fill(seen, false);
    boolean ok = read(b, off, off + len, cols, base, row);
    for (int i = 0; i < kinds.length; i++) {
      if (!ok || !seen[i]) {
        cols[base + i].putNull(row);
      }
    }
    return ok;
  }

  /** Row `row`'s fields all null (an event that is not JSON). */
  void nulls(OnHeapColumnVector[] cols, int base, int row) {
    for (int i = 0; i < kinds.length; i++) {
      cols[base + i].putNull(row);
    }
  }

  private boolean read(byte[] b, int p, int end, OnHeapColumnVector[] cols, int base, int row) {
    p = ws(b, p, end);
    if (p >= end || b[p] != '{') {
      return false;
    }
    p = ws(b, p + 1, end);
    if (p < end && b[p] == '}') {
      return ws(b, p + 1, end) == end;
    }
    while (p < end) {
      if (b[p] != '"') {
        return false;
      }
      int ks = p + 1;
      int ke = ks;
      while (ke < end && b[ke] != '"') {
        if (b[ke] == '\\') {
          return false;
        }
        ke++;
      }
      if (ke >= end) {
        return false;
      }
      p = ws(b, ke + 1, end);
      if (p >= end || b[p] != ':') {
        return false;
      }
      p = ws(b, p + 1, end);
      int field = field(b, ks, ke);
      if (field == -2) {
        return false;
      }
      if (field < 0) {
        p = skip(b, p, end);
      } else {
        if (seen[field]) {
          return false;
        }
        seen[field] = true;
        p = value(b, p, end, kinds[field], cols[base + field], row);
      }
      if (p < 0) {
        return false;
      }
      p = ws(b, p, end);
      if (p >= end) {
        return false;
      }
      if (b[p] == '}') {
        return ws(b, p + 1, end) == end;
      }
      if (b[p] != ',') {
        return false;
      }
      p = ws(b, p + 1, end);
    }
    return false;
  }

  /** The field named `b[s, e)`; -1 for none; -2 for a name that differs from a field's only
   * in case (Spark's matching there is left to Spark). */
  private int field(byte[] b, int s, int e) {
    int n = e - s;
    for (int i = 0; i < names.length; i++) {
      byte[] name = names[i];
      if (name.length == n && java.util.Arrays.equals(b, s, e, name, 0, n)) {
        return i;
      }
    }
    String key = null;
    for (int i = 0; i < names.length; i++) {
      if (names[i].length == n || lowerNames[i].length() == n) {
        if (key == null) {
          key = new String(b, s, n, StandardCharsets.UTF_8).toLowerCase(java.util.Locale.ROOT);
        }
        if (key.equals(lowerNames[i])) {
          return -2;
        }
      }
    }
    return -1;
  }

  /** The value at `p` into `col`; the position after it, or -1 for one left to Spark. */
  private static int value(byte[] b, int p, int end, int kind, OnHeapColumnVector col, int row) {
    if (p >= end) {
      return -1;
    }
    int c = b[p];
    if (c == 'n') {
      if (!literal(b, p, end, "null")) {
        return -1;
      }
      col.putNull(row);
      return p + 4;
    }
    switch (kind) {
      case STRING: {
        if (c != '"') {
          return -1; // Spark keeps a non-string as its JSON text, re-written
        }
        int s = p + 1;
        int e = s;
        while (e < end && b[e] != '"') {
          if (b[e] == '\\') {
            return -1;
          }
          e++;
        }
        if (e >= end) {
          return -1;
        }
        col.putByteArray(row, b, s, e - s);
        return e + 1;
      }
      case BOOLEAN:
        if (c == 't' && literal(b, p, end, "true")) {
          col.putBoolean(row, true);
          return p + 4;
        }
        if (c == 'f' && literal(b, p, end, "false")) {
          col.putBoolean(row, false);
          return p + 5;
        }
        return -1;
      default:
        return number(b, p, end, kind, col, row);
    }
  }

  /**
   * A number token. The integer kinds take an integer of at most 18 digits (a long,
   * exactly) in their range, and leave the rest to Spark (Jackson refuses a fraction for
   * them, and reads a long past their range as an error). DOUBLE takes any number as
   * Jackson's `getDoubleValue` does: an integer through a long (so `-0` is 0.0), one of more
   * digits or with a fraction or exponent by `Double.parseDouble`, which rounds correctly,
   * as Jackson's parser does.
   */
  private static int number(byte[] b, int p, int end, int kind, OnHeapColumnVector col, int row) {
    boolean negative = b[p] == '-';
    int s = negative ? p + 1 : p;
    int e = s;
    long v = 0;
    while (e < end && b[e] >= '0' && b[e] <= '9') {
      v = v * 10 + (b[e] - '0');
      e++;
    }
    int digits = e - s;
    if (digits == 0 || (digits > 1 && b[s] == '0')) {
      return -1;
    }
    boolean integral = !(e < end && (b[e] == '.' || b[e] == 'e' || b[e] == 'E'));
    if (kind == DOUBLE && (!integral || digits > 18)) {
      return fraction(b, p, e, end, col, row);
    }
    if (!integral || digits > 18) {
      return -1;
    }
    if (negative) {
      v = -v;
    }
    switch (kind) {
      case LONG:
        col.putLong(row, v);
        return e;
      case INT:
        if (v < Integer.MIN_VALUE || v > Integer.MAX_VALUE) {
          return -1;
        }
        col.putInt(row, (int) v);
        return e;
      case DOUBLE:
        col.putDouble(row, (double) v); // rounds to nearest, as Jackson's long to double
        return e;
      default:
        return -1;
    }
  }

  /** The rest of a number token from `e` (a fraction, an exponent, or more digits), the
   * whole token `b[p, end of token)` read as a double. */
  private static int fraction(byte[] b, int p, int e, int end, OnHeapColumnVector col, int row) {
    while (e < end && ((b[e] >= '0' && b[e] <= '9') || b[e] == '.' || b[e] == 'e'
        || b[e] == 'E' || b[e] == '+' || b[e] == '-')) {
      e++;
    }
    try {
      col.putDouble(row, Double.parseDouble(new String(b, p, e - p, StandardCharsets.ISO_8859_1)));
    } catch (NumberFormatException notANumber) {
      return -1;
    }
    return e;
  }

  private static boolean literal(byte[] b, int p, int end, String word) {
    int n = word.length();
    if (p + n > end) {
      return false;
    }
    for (int i = 0; i < n; i++) {
      if (b[p + i] != word.charAt(i)) {
        return false;
      }
    }
    return true;
  }

  /** Past the JSON value at `p` (the event is valid JSON), or -1. */
  private static int skip(byte[] b, int p, int end) {
    int depth = 0;
    while (p < end) {
      int c = b[p];
      if (c == '"') {
        p++;
        while (p < end && b[p] != '"') {
          p += b[p] == '\\' ? 2 : 1;
        }
        if (p >= end) {
          return -1;
        }
        p++;
      } else if (c == '{' || c == '[') {
        depth++;
        p++;
      } else if (c == '}' || c == ']') {
        if (depth == 0) {
          return p;
        }
        depth--;
        p++;
      } else if (c == ',' && depth == 0) {
        return p;
      } else {
        p++;
      }
      if (depth == 0 && (c == '"' || c == '}' || c == ']')) {
        return p;
      }
    }
    return depth == 0 ? p : -1;
  }

  private static int ws(byte[] b, int p, int end) {
    while (p < end && (b[p] == ' ' || b[p] == '\t' || b[p] == '\n' || b[p] == '\r')) {
      p++;
    }
    return p;
  }
}
