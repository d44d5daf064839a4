"""The ProxyModel operator (kopf). Never imports torch: it runs in a small image and only
builds Job manifests, reads config.json, and follows the Jobs it created."""
