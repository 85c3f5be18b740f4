"""A private certificate authority for the tests' TLS endpoints (cryptography's, which Prefect brings):
a CA, a server certificate for 127.0.0.1 and a client certificate, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PrivateCA:
    """PEM files: the CA's certificate, the server's (for 127.0.0.1) and a client's, with their keys."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_context(self, *, client_certificates: bool = False) -> ssl.SSLContext:
        """A server's TLS context; with ``client_certificates``, one requiring a client certificate
        issued by this CA (mutual TLS)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.server_cert, self.server_key)
        if client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.ca)
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return path


def private_ca(folder: Path) -> PrivateCA:
    """A CA no system trusts, and the certificates it issued, under ``folder``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("rollout-capture test CA"))
        .issuer_name(_name("rollout-capture test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def issue(common_name: str, usage: x509.ObjectIdentifier, stem: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_path = folder / f"{stem}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert_path, _write_key(key, folder / f"{stem}.key")

    ca_path = folder / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server = issue("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, "server")
    client = issue("rollout-capture client", ExtendedKeyUsageOID.CLIENT_AUTH, "client")
    return PrivateCA(ca_path, *server, *client)
