//! The JSONPath subset CRD `additionalPrinterColumns` use: `.a.b`, `[0]`, `[*]` and
//! `[?(@.k=="v")]` filters; the first match is the cell.

use serde_json::Value;

#[derive(Debug, PartialEq)]
enum Step {
    Field(String),
    Index(usize),
    All,
    Filter(Vec<String>, String),
}

fn parse(path: &str) -> Option<Vec<Step>> {
    let p = path.trim();
    let p = p
        .strip_prefix('{')
        .and_then(|p| p.strip_suffix('}'))
        .unwrap_or(p);
    let p = p.strip_prefix('$').unwrap_or(p);
    let mut steps = Vec::new();
    let mut rest = p;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            if end == 0 {
                return None;
            }
            steps.push(Step::Field(r[..end].to_owned()));
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            let inner = &r[..end];
            rest = &r[end + 1..];
            if inner == "*" {
                steps.push(Step::All);
            } else if let Ok(i) = inner.parse() {
                steps.push(Step::Index(i));
            } else if let Some(f) = inner.strip_prefix("?(@.").and_then(|f| f.strip_suffix(')')) {
                let (field, value) = f.split_once("==")?;
                let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
                steps.push(Step::Filter(
                    field.trim().split('.').map(str::to_owned).collect(),
                    value.to_owned(),
                ));
            } else {
                let key = inner.trim_matches(|c| c == '"' || c == '\'');
                steps.push(Step::Field(key.to_owned()));
            }
        } else {
            return None;
        }
    }
    Some(steps)
}

/// Evaluates `path` against `obj`; `None` if the path is unsupported or matches nothing.
pub fn eval(obj: &Value, path: &str) -> Option<Value> {
    let steps = parse(path)?;
    let mut cur: Vec<&Value> = vec![obj];
    for step in &steps {
        let mut next = Vec::new();
        for v in cur {
            match step {
                Step::Field(f) => next.extend(v.get(f.as_str())),
                Step::Index(i) => next.extend(v.get(*i)),
                Step::All => next.extend(v.as_array().into_iter().flatten()),
                Step::Filter(field, want) => {
                    for item in v.as_array().into_iter().flatten() {
                        let mut x = Some(item);
                        for f in field {
                            x = x.and_then(|x| x.get(f.as_str()));
                        }
                        let matches = match x {
                            Some(Value::String(s)) => s == want,
                            Some(other) => {
                                let text = other.to_string();
                                text == *want
                            }
                            None => false,
                        };
                        if matches {
                            next.push(item);
                        }
                    }
                }
            }
        }
        cur = next;
    }
    cur.first().map(|v| (*v).clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn filters_and_indices() {
        let o = json!({"status": {"conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "Succeeded", "status": "True", "reason": "Succeeded"}]},
            "spec": {"a": [1, 2]}});
        assert_eq!(
            eval(&o, r#".status.conditions[?(@.type=="Succeeded")].status"#),
            Some(json!("True"))
        );
        assert_eq!(eval(&o, ".spec.a[1]"), Some(json!(2)));
        assert_eq!(eval(&o, "{.spec.a[*]}"), Some(json!(1)));
        assert_eq!(eval(&o, ".spec.missing"), None);
        assert_eq!(eval(&o, "nonsense"), None);
    }
}
