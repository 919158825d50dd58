"""The version of agentjet-client (its own module: code inside the package reads it without importing the
package root)."""

__version__ = "0.1.0"
