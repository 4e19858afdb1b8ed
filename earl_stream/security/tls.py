"""TLS for the HTTP endpoints (the rollout workers' OpenAI endpoints, every process's metrics endpoint), and the
read-only bearer token the metrics endpoints may require.

On with `security.tls=true`, and whenever `security.encrypt=true`. A process learns it from its environment
(`up` and its launchers set it; `worker --encrypt` implies it), since its endpoints start before it has the run's
config: $EARL_STREAM_TLS=1, and optionally $EARL_STREAM_TLS_CERT / _KEY / _CA, files the user gives
(`security.tls_cert_file` ...; the certificate must name every host it is served from).

Without files, the certificates come from the **run CA**, derived from the cluster secret like every other key
(an ECDSA P-256 key from HMAC-SHA256 of the worker-plane key under a fixed context, keys.py): every process that
holds the secret or the worker key issues itself a certificate for its own addresses, and nothing has to be copied.
The CA's certificate is public: `up` writes it to RUN_DIR/tls/ca.pem for agent programs, Prometheus and browsers
to trust, and every process can write it again (`run_ca_pem`).

Metrics token: with `security.metrics_auth=true` (on whenever TLS is), each metrics endpoint answers only a
request whose bearer token is the run's read-only key (keys.py), and counts the others
(`earl_security_refused_total{plane="metrics", reason="token"}`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from earl_stream.config.cluster import SecurityConfig
from earl_stream.errors import ConfigError
from earl_stream.security.encryption import encrypt_enabled

TLS_ENV = "EARL_STREAM_TLS"
TLS_CERT_ENV = "EARL_STREAM_TLS_CERT"
TLS_KEY_ENV = "EARL_STREAM_TLS_KEY"
TLS_CA_ENV = "EARL_STREAM_TLS_CA"
METRICS_AUTH_ENV = "EARL_STREAM_METRICS_AUTH"
CA_FILE = "tls/ca.pem"  # in RUN_DIR, written by `up`
READONLY_KEY_FILE = "keys/readonly"  # in RUN_DIR, written by `up` under metrics_auth: Prometheus' credentials_file
_CA_CONTEXT = b"earl_stream run CA v1"
_NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
_LEAF_DAYS = 825


def _on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def tls_enabled() -> bool:
    """Whether this process serves its HTTP endpoints over TLS ($EARL_STREAM_TLS, or encryption on)."""
    return _on(TLS_ENV) or encrypt_enabled()


def metrics_auth_enabled() -> bool:
    """Whether metrics endpoints require the read-only key ($EARL_STREAM_METRICS_AUTH, or TLS on)."""
    return _on(METRICS_AUTH_ENV) or tls_enabled()


def run_ca(secret: bytes) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The run CA's key and certificate, the same on every host holding `secret` (the cluster secret or a worker
    key: its seed derives from the worker-plane key, `security.keys.plane_key`, since workers serve HTTPS)."""
    from earl_stream.security.keys import Plane, plane_key

    seed = hmac.new(plane_key(secret, Plane.TLS_CA), _CA_CONTEXT, hashlib.sha256).digest()
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # of P-256
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (order - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"earl_stream run CA {seed[:4].hex()}")])
    public = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(int.from_bytes(seed[4:12], "big") | 1)
            .not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_BEFORE + datetime.timedelta(days=365 * 100))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def run_ca_pem(secret: bytes) -> str:
    """The run CA's certificate (PEM): what clients trust."""
    return run_ca(secret)[1].public_bytes(serialization.Encoding.PEM).decode()


def write_run_ca(secret: bytes, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_ca_pem(secret))
    return path


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    """Every name and address the endpoint may be reached by: the hosts given, this host's name and
    addresses, and loopback."""
    names = {h.strip("[]") for h in hosts if h and h.strip("[]") not in ("0.0.0.0", "::", "*")}
    names |= {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    for host in list(names):
        try:
            names |= {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        except (OSError, UnicodeError):
            pass
    entries: list[x509.GeneralName] = []
    for name in sorted(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name.split("%")[0])))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue(secret: bytes, hosts: list[str]) -> tuple[bytes, bytes]:
    """A fresh server certificate for `hosts`, signed by the run CA: (certificate PEM, key PEM)."""
    ca_key, ca_cert = run_ca(secret)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "earl_stream")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _cluster_secret() -> bytes:
    """This process's credential that derives the run CA: the cluster secret or the worker key."""
    from earl_stream.security.keys import KeyRole, role_of
    from earl_stream.security.secret import load_secret

    secret = load_secret()
    if secret is None or role_of(secret) not in (KeyRole.CLUSTER, KeyRole.WORKER):
        raise ConfigError("TLS with the run CA needs the cluster secret or the worker key (its CA key is derived "
                          "from them): pass --secret-file, or give security.tls_cert_file, tls_key_file and tls_ca_file")
    return secret


def server_context(hosts: list[str], secret: bytes | None = None) -> ssl.SSLContext | None:
    """The TLS context of an endpoint served at `hosts`; None when TLS is off (and no `secret` is given to
    force it). Files given by the user ($EARL_STREAM_TLS_CERT/_KEY) win over the run CA."""
    if secret is None and not tls_enabled():
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    cert_file, key_file = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
    if secret is None and cert_file and key_file:
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the TLS certificate {cert_file} with its key {key_file}: {exc}") from None
        return ctx
    cert, key = issue(secret if secret is not None else _cluster_secret(), hosts)
    with tempfile.TemporaryDirectory(prefix="earl-tls-") as tmp:  # ssl loads keys from files only
        (Path(tmp) / "cert.pem").write_bytes(cert)
        key_path = Path(tmp) / "key.pem"
        key_path.touch(0o600)
        key_path.write_bytes(key)
        ctx.load_cert_chain(Path(tmp) / "cert.pem", key_path)
    return ctx


def client_ca_pem(secret: bytes | None = None) -> str:
    """The CA certificate (PEM) that clients of this process's endpoints trust: the user's CA file, else the
    run CA's."""
    ca_file = os.environ.get(TLS_CA_ENV)
    if secret is None and ca_file:
        try:
            return Path(ca_file).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the TLS CA file {ca_file}: {exc}") from None
    return run_ca_pem(secret if secret is not None else _cluster_secret())


def client_context(ca_pem: str) -> ssl.SSLContext:
    """A client context that trusts only `ca_pem` (and checks the host name)."""
    try:
        return ssl.create_default_context(cadata=ca_pem)
    except ssl.SSLError as exc:
        raise ConfigError(f"not a usable CA certificate: {exc}") from None


def tls_env(security: SecurityConfig) -> dict[str, str]:
    """What every process of a run needs in its environment for `security` (its endpoints start before it has
    the run's config); a ConfigError names every problem with the files given."""
    given = {"tls_cert_file": security.tls_cert_file, "tls_key_file": security.tls_key_file,
             "tls_ca_file": security.tls_ca_file}
    problems = [f"security.{name}={path!r} does not exist" for name, path in given.items()
                if path and not Path(path).expanduser().is_file()]
    if any(given.values()) and not all(given.values()):
        problems.append("give security.tls_cert_file, tls_key_file and tls_ca_file together (missing: "
                        + ", ".join(f"security.{n}" for n, p in given.items() if not p) + ")")
    if not problems and all(given.values()):
        problems += _mismatches(*(Path(p).expanduser() for p in given.values()))
    if problems:
        raise ConfigError("invalid TLS files:\n  " + "\n  ".join(problems))
    env = {TLS_ENV: "1" if security.tls_on else "0", METRICS_AUTH_ENV: "1" if security.metrics_auth_on else "0"}
    if security.tls_cert_file:
        env.update({TLS_CERT_ENV: str(Path(security.tls_cert_file).expanduser().resolve()),
                    TLS_KEY_ENV: str(Path(security.tls_key_file).expanduser().resolve()),
                    TLS_CA_ENV: str(Path(security.tls_ca_file).expanduser().resolve())})
    return env


def _mismatches(cert_file: Path, key_file: Path, ca_file: Path) -> list[str]:
    """What does not fit together in the TLS files given: the key is not the certificate's, or the CA did not
    sign it (checked once at `up`, so that no endpoint of the run starts with them)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        ca = x509.load_pem_x509_certificate(ca_file.read_bytes())
    except (OSError, ValueError) as exc:
        return [f"cannot read a PEM certificate from {cert_file} or {ca_file}: {exc}"]
    problems = []
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        problems.append(f"security.tls_key_file {key_file} is not the key of {cert_file} ({exc})")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        problems.append(f"security.tls_ca_file {ca_file} did not sign {cert_file}: clients trusting it would refuse "
                        "the endpoints")
    return problems
