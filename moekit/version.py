"""moekit's version (its own module, so that lower layers can read it without importing the
package's public API)."""

VERSION = "0.1.0"
