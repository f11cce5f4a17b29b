package io.tierflow.jetstream;

import java.io.IOException;

/** A jetstream source error whose message says what to do, as the Python source's do. */
final class SourceException extends IOException {
  private static final long serialVersionUID = 1L;

  SourceException(String message) {
    super(message);
  }
}
