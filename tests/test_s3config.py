"""One S3 configuration for every client (issue 39 item 7): an endpoint given only by an AWS profile's config file or
only by ``AWS_ENDPOINT_URL_S3`` reaches the test S3 server through Storage's s3fs and through its pyarrow filesystem
(also Ray Train's), with the same credentials; expired credentials are asked again once from their provider (a real
``credential_process``), else one ``pairmine: error:`` line saying how to renew them."""

from __future__ import annotations

import json
import sys
import uuid

import pyarrow.fs as pafs
import pytest

from pairmine.operators.s3config import CurrentS3Handler, is_expired_token
from pairmine.operators.storage import CredentialsExpiredError, Storage, StorageError, is_transient
from tests.conftest import S3_ACCESS_KEY, S3_SECRET

DEAD = "http://127.0.0.1:1"  # nothing listens there: a client sent to it fails


def client_error(code: str, message: str, status: int = 400):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def round_trip(storage: Storage, key: str) -> None:
    """Write with s3fs, read with the pyarrow filesystem, and the other way round."""
    url = f"s3://pairmine-test/s3config/{key}-{uuid.uuid4().hex[:8]}"
    storage.write_bytes(f"{url}/by-s3fs", b"written by s3fs")
    fs, path = storage.arrow_filesystem(url)
    with fs.open_input_stream(f"{path}/by-s3fs") as f:
        assert f.read() == b"written by s3fs"
    with fs.open_output_stream(f"{path}/by-pyarrow") as f:
        f.write(b"written by pyarrow")
    assert storage.read_bytes(f"{url}/by-pyarrow") == b"written by pyarrow"


def same_values_for_both_clients(storage: Storage, endpoint: str) -> None:
    settings = storage.s3()
    s3fs, arrow = settings.s3fs_options(), settings.pyarrow_options()
    assert s3fs["endpoint_url"] == endpoint
    assert f"{arrow['scheme']}://{arrow['endpoint_override']}" == endpoint
    assert s3fs["client_kwargs"]["region_name"] == arrow["region"] == "us-east-1"  # AWS_DEFAULT_REGION (conftest)
    assert (s3fs["key"], s3fs["secret"]) == (arrow["access_key"], arrow["secret_key"]) == (S3_ACCESS_KEY, S3_SECRET)
    assert "token" not in s3fs and arrow["session_token"] is None
    assert S3_SECRET not in settings.describe() and S3_SECRET not in repr(settings)


@pytest.mark.parametrize("where", ["services section", "profile endpoint_url"])
def test_endpoint_from_the_profiles_config_file_only(s3_server, tmp_path, monkeypatch, where):
    """AWS_PROFILE's config file is the only place naming the server; AWS_ENDPOINT_URL is unset (conftest)."""
    config = tmp_path / "config"
    if where == "services section":  # botocore's lookup order: the services section before the profile's own key
        config.write_text(f"[profile pm]\nservices = pm-s3\nendpoint_url = {DEAD}\n\n"
                          f"[services pm-s3]\ns3 =\n  endpoint_url = {s3_server.endpoint}\n")
    else:
        config.write_text(f"[profile pm]\nendpoint_url = {s3_server.endpoint}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "pm")
    storage = Storage()
    settings = storage.s3()
    assert settings.endpoint_url == s3_server.endpoint
    expected = (f"the services section (s3 endpoint_url) of profile pm in {config}" if where == "services section"
                else f"endpoint_url of profile pm in {config}")
    assert settings.endpoint_source == expected
    same_values_for_both_clients(storage, s3_server.endpoint)
    assert isinstance(storage.arrow_filesystem("s3://pairmine-test/x")[0], pafs.S3FileSystem)
    round_trip(storage, where.replace(" ", "-"))


def test_endpoint_from_aws_endpoint_url_s3_only_also_for_ray_trains_filesystem(s3_server, monkeypatch):
    """``AWS_ENDPOINT_URL_S3`` wins over ``AWS_ENDPOINT_URL`` (here a dead port), and ``storage.endpoint_url`` over
    both; Ray Train's ``storage_filesystem`` (train.storage_args) is the same pyarrow filesystem."""
    from pairmine.pipeline.train import storage_args

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", DEAD)
    storage = Storage()
    assert (storage.s3().endpoint_url, storage.s3().endpoint_source) == (s3_server.endpoint, "AWS_ENDPOINT_URL_S3")
    assert storage.s3().region_source == "AWS_DEFAULT_REGION"
    assert storage.s3().credentials_source.startswith("the environment (AWS_ACCESS_KEY_ID")
    same_values_for_both_clients(storage, s3_server.endpoint)
    round_trip(storage, "env")

    out = f"s3://pairmine-test/s3config/train-{uuid.uuid4().hex[:8]}"
    args = storage_args(out, storage)
    assert args["storage_path"] == out[len("s3://"):] and isinstance(args["storage_filesystem"], pafs.S3FileSystem)
    with args["storage_filesystem"].open_output_stream(f"{args['storage_path']}/checkpoint") as f:
        f.write(b"a checkpoint")
    assert storage.read_bytes(f"{out}/checkpoint") == b"a checkpoint"

    with pytest.raises(StorageError) as e:  # storage.endpoint_url wins over both; a failure names what was used
        Storage(endpoint_url=DEAD, attempts=1).read_bytes("s3://pairmine-test/x")
    assert str(e.value).startswith("read s3://pairmine-test/x failed after 1 tries: ")
    assert str(e.value).endswith(f"(S3: endpoint {DEAD} (from storage.endpoint_url), region us-east-1 (from "
                                 "AWS_DEFAULT_REGION), credentials from the environment (AWS_ACCESS_KEY_ID, "
                                 "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN))")
    assert S3_SECRET not in str(e.value)
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert Storage().s3().endpoint_url == ""  # botocore's switch: AWS's own endpoint


def test_credentials_from_a_profiles_credentials_file_are_the_same_for_both(s3_server, tmp_path, monkeypatch):
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[pm]\naws_access_key_id = {S3_ACCESS_KEY}\naws_secret_access_key = {S3_SECRET}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_PROFILE", "pm")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    storage = Storage()
    assert storage.s3().credentials_source == f"profile pm in {credentials}"
    same_values_for_both_clients(storage, s3_server.endpoint)
    round_trip(storage, "credentials-file")


def test_unknown_profile_is_one_user_error(monkeypatch, tmp_path):
    from pairmine.pipeline.cli import user_error

    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_PROFILE", "nosuchprofile")
    with pytest.raises(Exception) as e:
        Storage().read_bytes("s3://pairmine-test/anything")
    assert user_error(e.value) == ("the AWS configuration cannot be read: The config profile (nosuchprofile) "
                                   "could not be found")


def test_expired_token_is_told_apart():
    """botocore's codes, s3fs's translation of them (a PermissionError), pyarrow's and Ray's texts."""
    from s3fs.errors import translate_boto_error

    expired = client_error("ExpiredToken", "The provided token has expired.")
    assert is_expired_token(expired) and not is_transient(expired)
    assert is_expired_token(client_error("ExpiredTokenException", "The security token included in the request is "
                                                                  "expired"))
    translated = translate_boto_error(expired)
    assert isinstance(translated, PermissionError) and is_expired_token(translated)
    assert is_expired_token(OSError("When reading information for key 'k' in bucket 'b': AWS Error ACCESS_DENIED "
                                    "during HeadObject operation: The provided token has expired."))
    wrapped = RuntimeError("Training failed")
    wrapped.__cause__ = OSError("Ray Train: ExpiredToken")
    assert is_expired_token(wrapped)
    assert not is_expired_token(client_error("AccessDenied", "Access Denied", 403))
    assert not is_expired_token(client_error("InvalidAccessKeyId", "The access key ID you provided does not exist"))


def credential_process_profile(tmp_path, monkeypatch, endpoint: str):
    """Profile ``pm`` whose credentials come from a ``credential_process`` (botocore's ProcessProvider; with an
    ``Expiration`` they are RefreshableCredentials) that gives the test keys and logs each call to ``calls``."""
    calls = tmp_path / "calls"
    script = tmp_path / "creds.py"
    script.write_text(
        "import datetime, json, sys\n"
        f"open({str(calls)!r}, 'a').write('call\\n')\n"
        "expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {S3_ACCESS_KEY!r}, 'SecretAccessKey': {S3_SECRET!r}, "
        "'Expiration': expires.isoformat()}))\n")
    config = tmp_path / "config"
    config.write_text(f"[profile pm]\ncredential_process = {sys.executable} {script}\n"
                      f"endpoint_url = {endpoint}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_PROFILE", "pm")
    return calls, config


def test_expired_token_asks_the_provider_again_once_then_the_read_succeeds(s3_server, tmp_path, monkeypatch):
    calls, config = credential_process_profile(tmp_path, monkeypatch, s3_server.endpoint)
    storage = Storage(attempts=1)  # no retry of its own: the renewed credentials get a try of their own
    url = f"s3://pairmine-test/s3config/expired-{uuid.uuid4().hex[:8]}"
    storage.write_bytes(url, b"still here")
    settings = storage.s3()
    assert settings.refreshable and settings.credentials_source == f"the credential_process of profile pm in {config}"
    assert calls.read_text().count("call") == 1
    assert isinstance(storage.arrow_filesystem(url)[0].handler, CurrentS3Handler)  # renewed credentials, no snapshot
    round_trip(storage, "credential-process")

    tries = []

    def read():  # the first try meets the server's answer to an expired token; the next reads for real
        tries.append(1)
        if len(tries) == 1:
            raise client_error("ExpiredToken", "The provided token has expired.")
        fs, path = storage.fs(url)
        return fs.cat_file(path)

    assert storage.retry("read", url, read) == b"still here"
    assert len(tries) == 2 and calls.read_text().count("call") == 2  # asked once more, then read


def test_expired_again_after_renewal_is_one_line_saying_how_to_renew(s3_server, tmp_path, monkeypatch):
    from pairmine.pipeline.cli import user_error

    calls, config = credential_process_profile(tmp_path, monkeypatch, s3_server.endpoint)
    storage = Storage(attempts=3)
    tries = []

    def expired():
        tries.append(1)
        raise client_error("ExpiredToken", "The provided token has expired.")

    with pytest.raises(CredentialsExpiredError) as e:
        storage.retry("read", "s3://pairmine-test/x", expired)
    assert len(tries) == 2 and calls.read_text().count("call") == 2  # one renewal, no retries of an expired token
    message = user_error(e.value)
    assert message == (f"read s3://pairmine-test/x failed: the S3 credentials (from the credential_process of "
                       f"profile pm in {config}) have expired and the renewed ones were refused too; check that the "
                       f"credential_process of profile pm in {config} still issues credentials, then run the same "
                       "command again (a run resumes where it stopped)")
    assert "\n" not in message and S3_SECRET not in message


def test_expired_session_token_of_the_environment_is_one_line_at_once(monkeypatch):
    """Static temporary credentials (AWS_SESSION_TOKEN exported): asking again gives the same, so no retry."""
    from pairmine.pipeline.cli import user_error

    monkeypatch.setenv("AWS_SESSION_TOKEN", "an-expired-session-token")
    storage = Storage(attempts=3)
    assert storage.s3().temporary and not storage.s3().refreshable
    tries = []

    def expired():
        tries.append(1)
        raise client_error("ExpiredToken", "The provided token has expired.")

    with pytest.raises(CredentialsExpiredError) as e:
        storage.retry("write", "s3://pairmine-test/y", expired)
    assert len(tries) == 1
    assert user_error(e.value) == (
        "write s3://pairmine-test/y failed: the S3 credentials (from the environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)) have expired and their provider gives no new ones; export new "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (e.g. `aws configure export-credentials "
        "--format env`), then run the same command again (a run resumes where it stopped)")
    assert "an-expired-session-token" not in json.dumps(str(e.value))
