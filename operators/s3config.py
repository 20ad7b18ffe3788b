"""One S3 configuration for every client (issue 39 item 7).

s3fs (botocore underneath) reads an endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and from the AWS
profile's config file; pyarrow's ``S3FileSystem`` (Ray Train's checkpoints, Ray Data's reads) reads neither
(apache/arrow#44119), so left to themselves the two can talk to different servers. Here the endpoint, region and
credentials are resolved once per process with botocore's own rules (a botocore session: ``AWS_PROFILE``,
``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``, the credential provider chain), the ``[storage]`` keys taking
precedence, and :class:`S3Settings` hands the same values to s3fs (:meth:`S3Settings.s3fs_options`) and to pyarrow
(:meth:`S3Settings.pyarrow_options`). It also records which source won each value (:meth:`S3Settings.describe`, for
a log line or an error message); it never shows a credential.

Order of precedence:
  endpoint: ``storage.endpoint_url``, ``$AWS_ENDPOINT_URL_S3``, ``$AWS_ENDPOINT_URL``, the profile's ``services``
  section (``s3 = endpoint_url = ...``), the profile's ``endpoint_url``, else AWS's own endpoint
  (``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`` skips all but the first, as botocore does);
  region: ``storage.region``, ``$AWS_DEFAULT_REGION``, the profile's ``region``, else ``us-east-1`` for a custom
  endpoint (what botocore signs with) and each bucket's own region on AWS;
  credentials: ``storage.access_key_id`` / ``secret_access_key`` / ``session_token``, else botocore's chain
  (environment, shared credentials file, config file, assume-role, web identity, SSO, container, instance role).

Temporary credentials from a provider that renews them (assume-role, web identity, SSO, container or instance role,
a ``credential_process`` giving an expiry) are renewed by botocore before they expire each time the settings are
read; :func:`refresh` asks the provider again after an ``ExpiredToken`` error (:func:`is_expired_token`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, dataclass, field

import pyarrow.fs as pafs

from pairmine.operators.errors import PairmineError

log = logging.getLogger("pairmine")

# Error codes (botocore ClientError) and texts (pyarrow's OSError, Ray's wrapped errors) of expired credentials.
EXPIRED_TOKEN_CODES = frozenset({"ExpiredToken", "ExpiredTokenException"})
EXPIRED_TOKEN_TEXTS = ("ExpiredToken", "EXPIRED_TOKEN", "token has expired", "token included in the request is expired")
_ENDPOINT_SOURCES = {  # botocore's lookup locations (ConfiguredEndpointProvider) -> what the user set
    "environment_service": "AWS_ENDPOINT_URL_S3",
    "environment_global": "AWS_ENDPOINT_URL",
    "config_service": "the services section (s3 endpoint_url) of profile {profile} in {config}",
    "config_global": "endpoint_url of profile {profile} in {config}",
}
_CREDENTIAL_SOURCES = {  # botocore's Credentials.method -> where the user finds them
    "env": "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)",
    "shared-credentials-file": "profile {profile} in {credentials}",
    "config-file": "profile {profile} in {config}",
    "custom-process": "the credential_process of profile {profile} in {config}",
    "assume-role": "assume-role of profile {profile} in {config}",
    "assume-role-with-web-identity": "web identity (AWS_WEB_IDENTITY_TOKEN_FILE / AWS_ROLE_ARN or profile {profile})",
    "sso": "SSO of profile {profile} in {config}",
    "container-role": "the container's role (AWS_CONTAINER_CREDENTIALS_*)",
    "iam-role": "the instance's role (EC2 instance metadata)",
}
_RENEW = {  # Credentials.method -> how the user renews expired ones
    "storage": "set new storage.access_key_id / secret_access_key / session_token",
    "env": "export new AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (e.g. `aws configure "
           "export-credentials --format env`)",
    "shared-credentials-file": "write new keys for profile {profile} into {credentials}",
    "config-file": "write new keys for profile {profile} into {config}",
    "sso": "run `aws sso login --profile {profile}`",
}


class S3ConfigError(PairmineError, ValueError):
    """The AWS configuration cannot be read (``AWS_PROFILE`` names no profile, a profile's ``services`` section is
    missing, a malformed config file); the message names the file or variable."""


@dataclass(frozen=True)
class S3Settings:
    """The endpoint, region and credentials every S3 client of a process gets, with the source of each.

    ``endpoint_url`` empty: AWS's own endpoint; ``region`` empty: none configured (each bucket's own region on AWS).
    ``refreshable``: the credentials come from a provider that renews them (botocore ``RefreshableCredentials``);
    ``temporary``: they carry a session token.
    """

    endpoint_url: str
    region: str
    endpoint_source: str
    region_source: str
    credentials_source: str
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)
    session_token: str = field(default="", repr=False)
    temporary: bool = False
    refreshable: bool = False
    renew_hint: str = ""

    def describe(self) -> str:
        """One line naming each value and the source that won, credentials hidden (``redact``), e.g. ``endpoint
        http://127.0.0.1:8333 (from AWS_ENDPOINT_URL_S3), region us-east-1 (from AWS_DEFAULT_REGION), credentials
        from the environment (...)``."""
        from pairmine.operators.storage import redact

        shown = redact(asdict(self))  # the safety net: a key, secret or token never reaches the line
        region = shown["region"] or "of each bucket"
        return (f"endpoint {shown['endpoint_url'] or 'AWS'} (from {shown['endpoint_source']}), region {region} "
                f"(from {shown['region_source']}), credentials from {shown['credentials_source']}"
                + (", temporary" if self.temporary else "")
                + (", renewed by their provider" if self.refreshable else ""))

    def s3fs_options(self) -> dict:
        """s3fs's storage options: ``endpoint_url``, ``client_kwargs.region_name``, ``key`` / ``secret`` /
        ``token``, each only when resolved (an empty value leaves it to botocore, which found none either)."""
        opts: dict = {}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.region:
            opts["client_kwargs"] = {"region_name": self.region}
        if self.access_key_id:
            opts["key"], opts["secret"] = self.access_key_id, self.secret_access_key
            if self.session_token:
                opts["token"] = self.session_token
        return opts

    def pyarrow_options(self, bucket: str = "") -> dict:
        """``pyarrow.fs.S3FileSystem`` keyword arguments with the same values: ``endpoint_override`` (host[:port])
        and ``scheme``, ``region``, ``access_key`` / ``secret_key`` / ``session_token``. pyarrow needs a region:
        with none configured on AWS it is ``bucket``'s (``pyarrow.fs.resolve_s3_region``; ``us-east-1`` when that
        fails or no bucket is given)."""
        opts: dict = {"connect_timeout": 5.0, "request_timeout": 60.0}
        if self.endpoint_url:
            scheme, _, rest = self.endpoint_url.partition("://")
            opts["scheme"], opts["endpoint_override"] = (scheme, rest.rstrip("/")) if rest else ("https", scheme)
        region = self.region
        if not region and bucket:
            try:
                region = pafs.resolve_s3_region(bucket)
            except OSError as e:
                log.debug("region of bucket %s not resolved (%s): us-east-1", bucket, type(e).__name__)
        opts["region"] = region or "us-east-1"
        if self.access_key_id:
            opts.update(access_key=self.access_key_id, secret_key=self.secret_access_key,
                        session_token=self.session_token or None)
        return opts


@dataclass
class _Resolved:
    settings: S3Settings
    credentials: object  # botocore Credentials (RefreshableCredentials renew themselves), or None


_CACHE: dict[tuple, _Resolved] = {}
_LOCK = threading.Lock()
_ENV_PREFIXES = ("AWS_",)


def _key(endpoint_url: str, region: str, access_key_id: str, secret_access_key: str, session_token: str) -> tuple:
    """The cache key: the ``[storage]`` values, the AWS variables of the environment and the config files' mtimes
    (a changed variable or file is read again)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    files = []
    for var, default in (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")):
        path = os.path.expanduser(os.environ.get(var) or default)
        try:
            files.append((path, os.stat(path).st_mtime_ns))
        except OSError:
            files.append((path, None))
    return endpoint_url, region, access_key_id, secret_access_key, session_token, env, tuple(files)


def resolve(endpoint_url: str = "", region: str = "", access_key_id: str = "", secret_access_key: str = "",
            session_token: str = "") -> S3Settings:
    """The :class:`S3Settings` for these ``[storage]`` values (empty: botocore's resolution, see the module
    docstring), resolved once per process and kept while the AWS variables and config files stay the same.
    Credentials of a provider that renews them are renewed here when botocore finds them close to expiry. The first
    resolution logs :meth:`S3Settings.describe` (INFO).

    Raises:
        S3ConfigError: the AWS configuration cannot be read (unknown ``AWS_PROFILE``, missing ``services`` section,
            malformed file).
    """
    key = _key(endpoint_url, region, access_key_id, secret_access_key, session_token)
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            found = _CACHE[key] = _resolve(endpoint_url, region, access_key_id, secret_access_key, session_token)
            log.info("S3: %s", found.settings.describe())
        elif found.credentials is not None:  # a provider's credentials: renewed by botocore when close to expiry
            found.settings = _with_credentials(found.settings, found.credentials)
        return found.settings


def refresh(endpoint_url: str = "", region: str = "", access_key_id: str = "", secret_access_key: str = "",
            session_token: str = "") -> S3Settings | None:
    """Ask the credential provider again (a new botocore session), after an ``ExpiredToken`` error: the new
    :class:`S3Settings` when the credentials come from a provider that renews them (even if it hands the same ones
    again: the retry decides) or when the variables or files now hold other ones; None when there is nothing to ask
    (``[storage]``'s own keys) or they still hold the same ones.

    Raises:
        S3ConfigError: as :func:`resolve`.
    """
    if access_key_id:  # [storage]'s own keys: nothing to ask
        return None
    key = _key(endpoint_url, region, access_key_id, secret_access_key, session_token)
    with _LOCK:
        old = _CACHE.get(key)
        new = _CACHE[key] = _resolve(endpoint_url, region, access_key_id, secret_access_key, session_token)
    same = old is not None and (old.settings.access_key_id, old.settings.secret_access_key,
                                old.settings.session_token) == (new.settings.access_key_id,
                                                                new.settings.secret_access_key,
                                                                new.settings.session_token)
    if same and not new.settings.refreshable:
        return None
    log.warning("S3 credentials expired: asked %s again", new.settings.credentials_source)
    return new.settings


def _with_credentials(settings: S3Settings, credentials) -> S3Settings:
    from dataclasses import replace

    frozen = credentials.get_frozen_credentials()  # RefreshableCredentials: renewed here when due
    if (frozen.access_key, frozen.secret_key, frozen.token or "") == (
            settings.access_key_id, settings.secret_access_key, settings.session_token):
        return settings
    return replace(settings, access_key_id=frozen.access_key, secret_access_key=frozen.secret_key,
                   session_token=frozen.token or "", temporary=bool(frozen.token))


def _resolve(endpoint_url: str, region: str, access_key_id: str, secret_access_key: str,
             session_token: str) -> _Resolved:
    import botocore.exceptions
    import botocore.session
    from botocore.credentials import RefreshableCredentials

    session = botocore.session.Session()
    try:
        profile = session.profile or "default"
        config_file = os.path.expanduser(session.get_config_variable("config_file"))
        credentials_file = os.path.expanduser(session.get_config_variable("credentials_file"))
        names = {"profile": profile, "config": config_file, "credentials": credentials_file}
        scoped = session.get_scoped_config()
        endpoint, endpoint_source = _endpoint(session, scoped, endpoint_url, names)
        if region:
            region_source = "storage.region"
        else:
            region = session.get_config_variable("region") or ""
            region_source = ("AWS_DEFAULT_REGION" if region and os.environ.get("AWS_DEFAULT_REGION") == region
                             else f"region of profile {profile} in {config_file}" if region
                             else "none configured")
        if not region and endpoint:
            region, region_source = "us-east-1", "none configured: us-east-1, what botocore signs with"
        if access_key_id:
            credentials = None
            source, renew = "storage.access_key_id / storage.secret_access_key", _RENEW["storage"]
            settings_creds = dict(access_key_id=access_key_id, secret_access_key=secret_access_key,
                                  session_token=session_token, temporary=bool(session_token))
        else:
            credentials = session.get_credentials()
            method = getattr(credentials, "method", None) or "none"
            source = (_CREDENTIAL_SOURCES.get(method, f"botocore's {method!r} provider").format(**names)
                      if credentials is not None else "nowhere (no credentials found: unsigned requests fail)")
            hint = _RENEW.get(method)
            renew = hint.format(**names) if hint else f"check that {source} still issues credentials"
            settings_creds = {}
    except (botocore.exceptions.ProfileNotFound, botocore.exceptions.InvalidConfigError,
            botocore.exceptions.ConfigParseError) as e:
        raise S3ConfigError(f"the AWS configuration cannot be read: {e}") from None
    settings = S3Settings(endpoint, region, endpoint_source, region_source, source, renew_hint=renew,
                          refreshable=isinstance(credentials, RefreshableCredentials), **settings_creds)
    if credentials is not None:
        settings = _with_credentials(settings, credentials)
    return _Resolved(settings, credentials if isinstance(credentials, RefreshableCredentials) else None)


def _endpoint(session, scoped: dict, endpoint_url: str, names: dict) -> tuple[str, str]:
    """(endpoint, its source) by botocore's ConfiguredEndpointProvider order, ``storage.endpoint_url`` first."""
    if endpoint_url:
        return endpoint_url, "storage.endpoint_url"
    if session.get_config_variable("ignore_configured_endpoint_urls"):
        return "", "AWS (AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is set)"
    from botocore.configprovider import ConfiguredEndpointProvider

    provider = ConfiguredEndpointProvider(full_config=session.full_config, scoped_config=scoped, client_name="s3")
    order = getattr(provider, "_ENDPOINT_URL_LOOKUP_ORDER", None)
    if not order:  # a botocore without the per-location lookups: its answer, without the location
        found = provider.provide()
        return (found, "the AWS environment or config file") if found else ("", "AWS (none configured)")
    for location in order:
        found = getattr(provider, f"_get_endpoint_url_{location}")()
        if found:
            return found, _ENDPOINT_SOURCES.get(location, location).format(**names)
    return "", "AWS (none configured)"


def is_expired_token(error: BaseException) -> bool:
    """True when ``error`` (or an error in its ``__cause__`` / ``__context__`` / Ray ``cause`` chain) says the
    credentials expired: a botocore ClientError with code ``ExpiredToken`` / ``ExpiredTokenException``, or an
    error whose text carries it (pyarrow's OSError, s3fs's PermissionError "The provided token has expired.",
    Ray's wrapped errors)."""
    seen: set[int] = set()
    stack: list = [error]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        response = getattr(e, "response", None)
        if isinstance(response, dict) and str(response.get("Error", {}).get("Code", "")) in EXPIRED_TOKEN_CODES:
            return True
        text = str(e)
        if any(t in text for t in EXPIRED_TOKEN_TEXTS):
            return True
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])
    return False


class CurrentS3Handler(pafs.FSSpecHandler):
    """A pyarrow filesystem handler over a :class:`operators.storage.Storage`'s s3fs, looked up at every call, so
    that credentials its provider renews are used (``pyarrow.fs.PyFileSystem(CurrentS3Handler(storage))``). It
    pickles as the Storage, without credentials: each Ray worker resolves its own."""

    def __init__(self, storage):  # noqa: D107 - no FSSpecHandler.__init__: ``fs`` is the property below
        self.storage = storage

    @property
    def fs(self):
        return self.storage.fs("s3://")[0]

    def __eq__(self, other):
        return isinstance(other, CurrentS3Handler) and other.storage == self.storage

    def __ne__(self, other):
        return not self == other
