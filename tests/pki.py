"""Certificates for the auth and TLS tests, made with the `cryptography` package: EC
P-256 keys, valid for a day."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _certificate(subject: str, key, issuer: str, issuer_key, *extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: pathlib.Path, name: str, cert: x509.Certificate, key=None) -> tuple[str, str]:
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (folder / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(folder / f"{name}.pem"), str(folder / f"{name}.key")


def _authority(folder: pathlib.Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key, name, key, (x509.BasicConstraints(ca=True, path_length=None), True),
                        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), True))
    _write(folder, name, cert)
    return key, str(folder / f"{name}.pem")


def _leaf(folder: pathlib.Path, name: str, authority: str, authority_key, usages, names=()) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    extensions = [(x509.BasicConstraints(ca=False, path_length=None), True),
                  (x509.ExtendedKeyUsage(usages), False)]
    if names:
        extensions.append((x509.SubjectAlternativeName(list(names)), False))
    return _write(folder, name, _certificate(name, key, authority, authority_key, *extensions), key)


def make_pki(folder: pathlib.Path, token: str) -> dict[str, str]:
    """A CA; a certificate for a cluster's processes (127.0.0.1 and localhost; valid as
    server and as client, since each process calls the others); a client's; a stranger
    CA with a client certificate of its own; and a token file. Returns their paths."""
    ca_key, ca = _authority(folder, "interleaf-test-ca")
    server, server_key = _leaf(folder, "server", "interleaf-test-ca", ca_key,
                               [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                               [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client, client_key = _leaf(folder, "client", "interleaf-test-ca", ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH])
    stranger_key, stranger_ca = _authority(folder, "stranger-ca")
    intruder, intruder_key = _leaf(folder, "intruder", "stranger-ca", stranger_key, [ExtendedKeyUsageOID.CLIENT_AUTH])
    token_file = folder / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    return dict(ca=ca, server=server, server_key=server_key, client=client, client_key=client_key,
                stranger_ca=stranger_ca, intruder=intruder, intruder_key=intruder_key, token_file=str(token_file))
