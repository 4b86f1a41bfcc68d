"""Every key and its default: ember's own list (ember/config/defaults.py), for config files that start from
`configs.base.get_config()`. New config files can import `ember.config.defaults` directly.
"""

from ember.config.defaults import get_config  # noqa: F401
