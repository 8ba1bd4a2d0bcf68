"""TLS certificates and SuperNode authentication keys for a Flower deployment.

``make_deployment_keys(out, nodes)`` writes into ``out/``:

- ``ca.crt`` / ``ca.key``: a self-signed certificate authority. ``ca.crt`` is what
  clients trust: the SuperLink's ``--ssl-ca-certfile``, each SuperNode's
  ``--root-certificates`` and ``root-certificates`` in the ``flwr`` CLI's
  ``config.toml``. Keep ``ca.key`` offline; it only signs ``server.pem``.
- ``server.pem`` / ``server.key``: the SuperLink's TLS certificate (signed by the CA,
  valid for every requested host) and its key, for ``--ssl-certfile`` and
  ``--ssl-keyfile``.
- ``node-{i}.key`` / ``node-{i}.pub``: one ECDSA P-384 key pair per SuperNode for
  SuperNode authentication (``flower-superlink --enable-supernode-auth``). The
  OpenSSH private key goes to ``flower-supernode --auth-supernode-private-key``; the
  OpenSSH public key is registered with ``flwr supernode register node-{i}.pub``.

Private keys are unencrypted and written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import errno
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from task.errors import ConfigError

CURVE = ec.SECP384R1
CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class DeploymentKeys:
    """Paths of the files written by :func:`make_deployment_keys`."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: list[tuple[Path, Path]]  # (private, public) per SuperNode


def make_deployment_keys(
    out: Path,
    nodes: int,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = 365,
    force: bool = False,
) -> DeploymentKeys:
    """Create a CA, a SuperLink certificate for ``hosts`` and ``nodes`` SuperNode keys.

    Raises ``FileExistsError`` if ``out/ca.key`` exists, unless ``force`` is set.
    """
    if not hosts:
        raise ValueError("hosts must name at least one IP address or DNS name")
    out = Path(out)
    ca_key_path = out / "ca.key"
    if ca_key_path.exists() and not force:
        raise FileExistsError(
            errno.EEXIST, "refusing to overwrite (use force=True)", str(ca_key_path)
        )
    out.mkdir(parents=True, exist_ok=True)
    validity = dt.timedelta(days=days)

    ca_key = ec.generate_private_key(CURVE())
    ca_cert = _ca_certificate(ca_key, validity)
    server_key = ec.generate_private_key(CURVE())
    server_cert = _server_certificate(server_key, ca_cert, ca_key, hosts, validity)

    keys = deployment_key_paths(out, nodes)
    _write_certificate(keys.ca, ca_cert)
    _write_private(keys.ca_key, _pem_private_bytes(ca_key))
    _write_certificate(keys.server_cert, server_cert)
    _write_private(keys.server_key, _pem_private_bytes(server_key))
    for private_path, public_path in keys.node_keys:
        _write_node_key_pair(private_path, public_path)
    return keys


def deployment_key_paths(out: Path, nodes: int) -> DeploymentKeys:
    """Where :func:`make_deployment_keys` puts the files of a deployment of ``nodes`` SuperNodes."""
    out = Path(out)
    return DeploymentKeys(ca=out / "ca.crt", ca_key=out / "ca.key", server_cert=out / "server.pem",
                          server_key=out / "server.key",
                          node_keys=[(out / f"node-{i}.key", out / f"node-{i}.pub") for i in range(nodes)])


def load_deployment_keys(out: Path, nodes: int) -> DeploymentKeys:
    """The files of an earlier :func:`make_deployment_keys`; ConfigError naming a missing one."""
    keys = deployment_key_paths(out, nodes)
    needed = [keys.ca, keys.server_cert, keys.server_key] + [p for pair in keys.node_keys for p in pair]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(f"TLS files missing: {', '.join(missing[:4])} (create them with "
                          f"'flrep certs --out {out} --nodes {nodes}')")
    return keys


def _validity_window(validity: dt.timedelta) -> tuple[dt.datetime, dt.datetime]:
    """Return (not before, not after), tolerating small clock skew."""
    now = dt.datetime.now(dt.timezone.utc)
    return now - CLOCK_SKEW, now + validity


def _ca_certificate(
    key: ec.EllipticCurvePrivateKey, validity: dt.timedelta
) -> x509.Certificate:
    """Return a self-signed CA certificate for ``key``."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Flower deployment CA")])
    not_before, not_after = _validity_window(validity)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
        .sign(key, hashes.SHA256())
    )


def _server_certificate(
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    hosts: Sequence[str],
    validity: dt.timedelta,
) -> x509.Certificate:
    """Return a TLS server certificate for ``hosts``, signed by the CA."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    not_before, not_after = _validity_window(validity)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
            critical=False,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    """Key usage of a CA (``cert_sign``) or of an ECDSA TLS server key."""
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    """Return an IPAddress SAN entry for an IP literal, else a DNSName entry."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem_private_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Serialize ``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_node_key_pair(private_path: Path, public_path: Path) -> None:
    """Write a SuperNode authentication key pair in OpenSSH format."""
    key = ec.generate_private_key(CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write_private(private_path, private)
    public_path.write_bytes(public + b"\n")


def _write_certificate(path: Path, cert: x509.Certificate) -> None:
    """Write ``cert`` as PEM."""
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by the owner only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the file may have existed with a wider mode
    with os.fdopen(fd, "wb") as f:
        f.write(data)
