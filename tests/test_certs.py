"""Deployment keys: a CA-signed SuperLink certificate and SuperNode keys flwr accepts."""

import argparse
import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import PolicyBuilder, Store

from flower_app.tools.certs import make_deployment_keys

HOSTS = ["127.0.0.1", "localhost", "::1", "superlink.example.org"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_deployment_keys(tmp_path_factory.mktemp("keys"), nodes=2, hosts=HOSTS, days=30)


def _cert(path):
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_all_files_are_written(keys):
    names = {"ca.crt", "ca.key", "server.pem", "server.key", "node-0.key", "node-0.pub", "node-1.key", "node-1.pub"}
    paths = [keys.ca, keys.ca_key, keys.server_cert, keys.server_key, *(p for pair in keys.node_keys for p in pair)]
    assert {p.name for p in paths} == names
    assert all(p.is_file() and p.parent == keys.ca.parent for p in paths)


@pytest.mark.parametrize("host", HOSTS)
def test_server_certificate_verifies_against_the_ca_for_every_host(keys, host):
    ca, server = _cert(keys.ca), _cert(keys.server_cert)
    server.verify_directly_issued_by(ca)
    try:
        subject = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        subject = x509.DNSName(host)
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(subject)
    assert verifier.verify(server, []) == [server, ca]  # the chain up to the trusted CA


def test_server_certificate_names_exactly_the_requested_hosts(keys):
    san = _cert(keys.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "superlink.example.org"]


def test_server_key_matches_certificate_and_validity_is_requested_days(keys):
    server = _cert(keys.server_cert)
    key = serialization.load_pem_private_key(keys.server_key.read_bytes(), password=None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    assert 30 <= (server.not_valid_after_utc - server.not_valid_before_utc).days <= 31


def test_private_keys_are_owner_only(keys):
    for path in [keys.ca_key, keys.server_key, *(private for private, _ in keys.node_keys)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_node_keys_load_as_flower_supernode_and_flwr_register_do(keys):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

    for private_path, public_path in keys.node_keys:
        args = argparse.Namespace(auth_supernode_private_key=str(private_path), auth_supernode_public_key=None)
        _, public_key = _try_setup_client_authentication(args)  # what `flower-supernode` runs
        assert try_load_public_key(public_path) == public_key_to_bytes(public_key)  # what `flwr supernode register` runs


def test_refuses_to_overwrite_an_existing_ca_key_unless_forced(tmp_path):
    first = make_deployment_keys(tmp_path, nodes=1)
    ca_key = first.ca_key.read_bytes()
    with pytest.raises(FileExistsError) as err:
        make_deployment_keys(tmp_path, nodes=1)
    assert err.value.filename == str(first.ca_key)
    assert first.ca_key.read_bytes() == ca_key

    first.ca_key.chmod(0o644)
    second = make_deployment_keys(tmp_path, nodes=1, force=True)
    assert second.ca_key.read_bytes() != ca_key
    assert stat.S_IMODE(second.ca_key.stat().st_mode) == 0o600
