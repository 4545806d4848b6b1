"""Whether an S3 store's credentials may list its prefix, and so what S3's 403 for a read
of one object means.

S3 answers a read (GET, HEAD) of an absent object with 403, not 404, to a client whose
policy does not let it list the bucket (``s3:ListBucket``): for such a client a 403 is an
absent object. Whether it may list is learned by listing one key of the prefix (a policy's
``s3:prefix`` condition may allow that where HeadBucket is refused), when the store pings
or at the first read refused before any ping.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from botocore.exceptions import ClientError

from kvtier.storage import s3_errors
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

__all__ = ["ListPermission"]


class ListPermission:
    """What a store has learned about listing its prefix. Thread-safe.

    Args:
        describe: the bucket, endpoint and prefix, as the warning names them.
        list_one: lists one key of the prefix (a ListObjectsV2 with ``MaxKeys=1``),
            raising the client's errors.
        errors: what ``list_one`` raises for a failed request.

    Attributes:
        denied: whether the credentials may not list the prefix; None until learned.
    """

    def __init__(
        self,
        describe: str,
        list_one: Callable[[], object],
        errors: tuple[type[BaseException], ...],
    ) -> None:
        self.describe = describe
        self.denied: bool | None = None
        self._list_one = list_one
        self._errors = errors

    def learn(self) -> None:
        """List one key; a refusal (``AccessDenied``) sets ``denied`` and warns once.

        Raises:
            what ``list_one`` raised, but for ``AccessDenied``.
        """
        try:
            self._list_one()
        except ClientError as exc:
            if s3_errors.error_code(exc) != s3_errors.ACCESS_DENIED:
                raise
            warn_once(
                logger,
                f"{self.describe}: these credentials may not list the prefix (no "
                "s3:ListBucket), and S3 then answers 403, not 404, for an object not "
                "stored yet: kvtier reads that 403 as a miss. A chunk the policy does not "
                "let it read (s3:GetObject) is then a miss too; grant s3:ListBucket on "
                "the prefix to tell the two apart.",
                key=f"s3 no listing: {self.describe}",
            )
            self.denied = True
            return
        self.denied = False

    def is_denied_listing(self, exc: ClientError) -> bool:
        """Whether ``exc``, the answer to a listing, is the refusal ``denied`` records."""
        return bool(self.denied) and s3_errors.is_denied(exc)

    def is_absent(self, exc: ClientError) -> bool:
        """Whether the error answer to a read of one object means it is absent. A 403
        while ``denied`` is not known yet learns it first (a failure to learn leaves
        the 403 a failure)."""
        if self.denied is None and s3_errors.is_denied(exc):
            with contextlib.suppress(*self._errors):
                self.learn()
        return s3_errors.is_absent(exc, self.denied is True)
