"""S3 storage tests against a real SeaweedFS on 127.0.0.1 (see conftest.py)."""
