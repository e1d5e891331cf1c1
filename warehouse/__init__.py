"""The warehouse: Hive-partitioned Parquet tables, a manifest of finished runs, and DuckDB views."""
