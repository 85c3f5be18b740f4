"""Capture producers (spec 11): ``CaptureMiddleware`` for ASGI model servers, and the proxy.

The proxy (the app in ``rollout_capture.producer.proxy``, served by ``serve_proxy`` of
``rollout_capture.producer.server``) imports aiohttp and uvicorn, so it is not imported
here; the middleware needs neither.
"""

from rollout_capture.producer.middleware import CaptureMiddleware
from rollout_capture.producer.settings import ProducerSettings, ProxySettings
from rollout_capture.producer.verifier import VerifierCall, current_verifier_call

__all__ = ["CaptureMiddleware", "ProducerSettings", "ProxySettings", "VerifierCall", "current_verifier_call"]
