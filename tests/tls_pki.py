"""A throwaway PKI for TLS tests (the `tls_files` fixture of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path


class TLSFiles:
    """A throwaway PKI made at test time: one CA, a server certificate that is also the internal
    plane's client identity (SANs 127.0.0.1, localhost, cedserve-internal), and a client certificate."""

    def __init__(self, folder: Path) -> None:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        folder.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)

        def write_key(name: str) -> tuple[ec.EllipticCurvePrivateKey, str]:
            key = ec.generate_private_key(ec.SECP256R1())
            path = folder / f"{name}.key"
            path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
            return key, str(path)

        def issue(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                  signer: ec.EllipticCurvePrivateKey, extensions: list[tuple[x509.ExtensionType, bool]],
                  subject: x509.Name | None = None) -> str:
            subject = subject or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"cedserve test {name}")])
            builder = (x509.CertificateBuilder().subject_name(subject)
                       .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                       .not_valid_before(now - datetime.timedelta(minutes=5))
                       .not_valid_after(now + datetime.timedelta(days=1)))
            for ext, critical in extensions:
                builder = builder.add_extension(ext, critical)
            path = folder / f"{name}.pem"
            path.write_bytes(builder.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
            return str(path)

        ca_key, _ = write_key("ca")
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cedserve test CA")])
        self.ca = issue("ca", ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=None), True)],
                        subject=ca_name)
        server_key, self.server_key = write_key("server")
        sans = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                            x509.DNSName("localhost"), x509.DNSName("cedserve-internal")])
        both = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        self.server_cert = issue("server", server_key, ca_name, ca_key, [(sans, False), (both, False)])
        client_key, self.client_key = write_key("client")
        self.client_cert = issue("client", client_key, ca_name, ca_key,
                                 [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
