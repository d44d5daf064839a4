"""The demo (`python -m moe_proxy.demo`) and what it runs on: tiny real checkpoints made with
`transformers` (`tiny`) and an embedded SeaweedFS S3 server (`seaweed`, `s3`). Tests and
benchmarks use them too; the product path never does."""
