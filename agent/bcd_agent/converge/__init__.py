"""The converge runner and the types every section reports with."""
