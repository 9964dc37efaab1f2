"""The registry site: static pages of every registered model, built from the declarations."""

from .build import SiteError, build_site

__all__ = ["SiteError", "build_site"]
