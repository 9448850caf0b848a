"""Make a private certificate authority and one certificate for the coordinator and nodes, for
TLS on gRPC and HTTPS on the coordinator (docs/security.md):

    python scripts/make_certs.py --out certs --host 127.0.0.1 --host coord.example.org

writes certs/ca.pem (give it to every node: --tls-ca), certs/cert.pem and certs/key.pem (the
certificate, valid for every --host, and its private key, readable by its owner only). Needs the
`cryptography` package (pip install cryptography). Run it once per site; make one per machine by
running it with the same --ca-dir and that machine's --host.
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PEM = serialization.Encoding.PEM


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _certificate_authority(folder: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in `folder` (ca.pem, ca-key.pem), made there first if there is none."""
    cert_file, key_file = folder / "ca.pem", folder / "ca-key.pem"
    if cert_file.exists() and key_file.exists():
        return (x509.load_pem_x509_certificate(cert_file.read_bytes()),
                serialization.load_pem_private_key(key_file.read_bytes(), password=None))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("Ravnest CA")).issuer_name(_name("Ravnest CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    _write(cert_file, cert.public_bytes(PEM))
    _write(key_file, key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True)
    return cert, key


def make_certificates(out: Path, hosts: list[str], ca_dir: Path | None = None, days: int = 365) -> dict[str, Path]:
    """ca.pem, cert.pem and key.pem in `out` for `hosts` (names or IP addresses); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _certificate_authority(ca_dir or out, days)
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": out / "ca.pem", "cert": out / "cert.pem", "key": out / "key.pem"}
    if (ca_dir or out) != out:
        _write(paths["ca"], ca_cert.public_bytes(PEM))
    _write(paths["cert"], cert.public_bytes(PEM))
    _write(paths["key"], key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for ca.pem, cert.pem, key.pem")
    parser.add_argument("--host", action="append", required=True, help="a name or IP the certificate is for "
                                                                       "(repeatable)")
    parser.add_argument("--ca-dir", type=Path, default=None, help="the CA's folder (default: --out); made if empty")
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args()
    paths = make_certificates(args.out, args.host, args.ca_dir, args.days)
    print("\n".join(f"{what}: {path}" for what, path in paths.items()))


if __name__ == "__main__":
    main()
