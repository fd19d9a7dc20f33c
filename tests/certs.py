"""Test certificates, made here with ``cryptography``: a CA and a leaf it signed, for
``127.0.0.1`` and ``localhost``, usable as both server and client certificate (what the
roles of a cluster on one machine present to each other). Each ``CertificateSet`` is a new
CA, so two sets stand for two clusters that must not trust each other."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertificateSet:
    """PEM files: ``ca`` (the root), ``cert`` and ``key`` (the leaf the CA signed)."""

    ca: Path
    cert: Path
    key: Path

    def flags(self) -> tuple[str, ...]:
        return (f"--tls-cert={self.cert}", f"--tls-key={self.key}", f"--tls-ca={self.ca}")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_certificates(directory: Path, name: str = "splitserve-test") -> CertificateSet:
    """A fresh CA and a leaf for 127.0.0.1 / localhost, written under ``directory``."""
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} CA"))
        .issuer_name(_name(f"{name} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    alt_names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaf_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} node"))
        .issuer_name(ca_cert.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    files = CertificateSet(directory / "ca.pem", directory / "node.pem", directory / "node-key.pem")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(leaf_cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem(leaf_key))
    files.key.chmod(0o600)
    return files
