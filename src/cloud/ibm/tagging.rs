//! User tags on IBM Cloud resources, through the Global Tagging API (`/v3/tags`): the VPC API
//! takes no tags on an instance (only on its volumes), so ownership tags are attached to the
//! instance's CRN here. Tags are `key:value` strings; IBM compares them case-insensitively.

use std::sync::Arc;

use http::Method;
use serde_json::{Value, json};

use super::http::{CallError, Http, encode, endpoint_ok};
use super::iam::Iam;

/// IBM's public Global Tagging endpoint.
pub const DEFAULT_TAGGING_URL: &str = "https://tags.global-search-tagging.cloud.ibm.com";
/// Longest user tag IBM accepts.
pub const MAX_TAG_LEN: usize = 128;

/// True when `tag` is a user tag IBM accepts: at most 128 of `A-Z a-z 0-9 space _ - . :`.
pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= MAX_TAG_LEN
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b' ' | b'_' | b'-' | b'.' | b':'))
}

/// Why a tagging call failed.
#[derive(Debug, thiserror::Error)]
pub enum TaggingError {
    #[error("Global Tagging API URL {0:?} is not https (plain http is allowed on loopback only)")]
    InvalidUrl(String),
    #[error("Global Tagging API {op}: {source}")]
    Call {
        op: &'static str,
        #[source]
        source: CallError,
    },
    #[error("Global Tagging API {op} refused for {resource}: {message}")]
    Refused {
        op: &'static str,
        resource: String,
        message: String,
    },
}

impl TaggingError {
    /// The HTTP status of an error answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Call { source, .. } => source.status(),
            _ => None,
        }
    }
}

/// A Global Tagging client.
pub struct Tagging {
    base: String,
    iam: Arc<Iam>,
    http: Http,
}

impl Tagging {
    /// A client for `url` ([`DEFAULT_TAGGING_URL`] in production).
    pub fn new(url: &str, iam: Arc<Iam>, http: Http) -> Result<Self, TaggingError> {
        let base = url.trim_end_matches('/').to_owned();
        if !endpoint_ok(&base) {
            return Err(TaggingError::InvalidUrl(url.to_owned()));
        }
        Ok(Self { base, iam, http })
    }

    /// The user tags attached to `crn`.
    pub async fn tags_of(&self, crn: &str) -> Result<Vec<String>, TaggingError> {
        let url = format!(
            "{}/v3/tags?tag_type=user&attached_to={}&limit=1000",
            self.base,
            encode(crn)
        );
        let v = self
            .http
            .call(&self.iam, Method::GET, &url, &[], None)
            .await
            .map_err(|source| TaggingError::Call { op: "list", source })?;
        Ok(v.get("items")
            .and_then(Value::as_array)
            .map(|items| {
                items
                    .iter()
                    .filter_map(|t| t.get("name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Attaches (`attach`) or detaches `tags` on `crn`.
    async fn change(
        &self,
        op: &'static str,
        crn: &str,
        tags: &[String],
    ) -> Result<(), TaggingError> {
        if tags.is_empty() {
            return Ok(());
        }
        let url = format!("{}/v3/tags/{op}?tag_type=user", self.base);
        let body = json!({"resources": [{"resource_id": crn}], "tag_names": tags});
        let v = self
            .http
            .call(&self.iam, Method::POST, &url, &[], Some(&body))
            .await
            .map_err(|source| TaggingError::Call { op, source })?;
        let failed = v
            .get("results")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|r| r.get("is_error").and_then(Value::as_bool) == Some(true));
        if let Some(r) = failed {
            return Err(TaggingError::Refused {
                op,
                resource: crn.to_owned(),
                message: r
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("is_error")
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Attaches `tags` to `crn`.
    pub async fn attach(&self, crn: &str, tags: &[String]) -> Result<(), TaggingError> {
        self.change("attach", crn, tags).await
    }

    /// Detaches `tags` from `crn`.
    pub async fn detach(&self, crn: &str, tags: &[String]) -> Result<(), TaggingError> {
        self.change("detach", crn, tags).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_ibm_accepts() {
        assert!(valid_tag("taskrunid:tenant-a:build-1"));
        assert!(valid_tag("multi-platform-attempt:0.1"));
        assert!(!valid_tag("a/b"));
        assert!(!valid_tag(""));
        assert!(!valid_tag(&"a".repeat(129)));
    }
}
