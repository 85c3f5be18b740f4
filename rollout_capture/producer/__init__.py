"""Capture producers (spec 11): ``CaptureMiddleware`` for ASGI model servers, and the proxy.

The proxy (``rollout_capture.producer.proxy``) imports httpx and uvicorn, so it is not
imported here; the middleware needs neither.
"""

from rollout_capture.producer.middleware import CaptureMiddleware
from rollout_capture.producer.settings import ProducerSettings, ProxySettings
from rollout_capture.producer.verifier import VerifierCall, current_verifier_call

__all__ = ["CaptureMiddleware", "ProducerSettings", "ProxySettings", "VerifierCall", "current_verifier_call"]
