"""Small helpers every layer may use: process-level policy shared by the core and its workers."""
